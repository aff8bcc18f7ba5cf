"""``rabenseifner``: recursive-halving reduce-scatter, then recursive-doubling allgather.

The buffer is cut into one **block** per virtual rank (``2^k`` of them after folding a
non-power-of-two world, see :mod:`.power_of_two`); each exchange is cut into **segments**.

* Reduce-scatter by recursive halving (:mod:`.halving`), distance ``m = 2^(k-1) .. 1``: virtual
  rank ``v`` keeps the half of its ``2m`` blocks that contains block ``v``, sends the other half
  to ``v xor m`` and reduces the half it receives into its own. Invariant: after distance ``m``,
  ``v`` holds its aligned ``m`` blocks reduced over its aligned group of ``p/m`` ranks; at the
  end, block ``v`` reduced over everyone. Message sizes halve every round.
* Allgather, distance ``m = 1 .. 2^(k-1)``: exchange the owned ``m`` blocks with ``v xor m``,
  received straight into the buffer; owned ranges double. Each block's final value was computed
  on one rank only, so every rank ends with the same bytes.

Cost (alpha-beta): ``2 log2 p`` steps moving ``2 n (p-1)/p`` elements, ``2 log2 p alpha +
2 n (p-1)/p beta`` plus ``n (p-1)/p`` local reduces: the ring's bandwidth with a logarithmic
latency term (+ two steps of ``n`` on folded pairs). Extra memory: ``window + 1`` segments.
"""

from __future__ import annotations

from commlib.algorithms.common.halving import block_span, recursive_halving
from commlib.algorithms.common.partition import segment_elements, split_bounds
from commlib.algorithms.common.pipeline import scratch_slots
from commlib.algorithms.common.power_of_two import Fold, fold_in, fold_out
from commlib.ops import ReduceOp

__all__ = ["allreduce_rabenseifner"]


def allreduce_rabenseifner(transport, buf, op: ReduceOp, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    if size == 1 or buf.size == 0:
        return
    fold = Fold(size, rank)
    fold_in(transport, fold, buf, op, segment_bytes)
    virtual = fold.virtual_rank
    if virtual >= 0 and fold.power > 1:
        blocks = split_bounds(0, buf.size, fold.power)
        segment_elems = segment_elements(segment_bytes, buf.itemsize)
        slots = scratch_slots(transport, min(segment_elems, buf.size), buf.dtype)
        recursive_halving(transport, buf, op, virtual=virtual, power=fold.power, real_rank=fold.real_rank,
                          blocks=blocks, segment_elems=segment_elems, slots=slots)
        distance = 1
        while distance < fold.power:
            partner_virtual = virtual ^ distance
            partner = fold.real_rank(partner_virtual)
            mine = block_span(blocks, (virtual // distance) * distance, distance)
            theirs = block_span(blocks, (partner_virtual // distance) * distance, distance)
            transport.step(f"doubling distance {distance}")
            transport.exchange(((buf[mine[0]:mine[1]], partner),) if mine[1] > mine[0] else (),
                               ((buf[theirs[0]:theirs[1]], partner),) if theirs[1] > theirs[0] else ())
            distance *= 2
    fold_out(transport, fold, buf)

