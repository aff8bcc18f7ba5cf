"""``rabenseifner``: recursive-halving reduce-scatter, then recursive-doubling allgather.

The buffer is cut into one **block** per virtual rank (``2^k`` of them after folding a
non-power-of-two world, see :mod:`.power_of_two`); each exchange is cut into **segments**.

* Reduce-scatter, distance ``m = 2^(k-1) .. 1``: virtual rank ``v`` owns a contiguous range of
  ``2m`` blocks; it keeps the half that contains block ``v``, sends the other half to ``v xor m``
  and reduces the half it receives into its own (the lower rank's operand first). Invariant: after
  distance ``m``, ``v`` holds its aligned ``m`` blocks reduced over its aligned group of ``p/m``
  ranks; at the end, block ``v`` reduced over everyone. Message sizes halve every round.
* Allgather, distance ``m = 1 .. 2^(k-1)``: exchange the owned ``m`` blocks with ``v xor m``,
  received straight into the buffer; owned ranges double. Each block's final value was computed
  on one rank only, so every rank ends with the same bytes.

Cost (alpha-beta): ``2 log2 p`` steps moving ``2 n (p-1)/p`` elements, ``2 log2 p alpha +
2 n (p-1)/p beta`` plus ``n (p-1)/p`` local reduces: the ring's bandwidth with a logarithmic
latency term (+ two steps of ``n`` on folded pairs). Extra memory: ``window + 1`` segments.
"""

from __future__ import annotations

from ..ops import ReduceOp
from .partition import segment_count, segment_elements, split_bounds
from .pipeline import Stage, run_stages, scratch_slots
from .power_of_two import Fold, fold_in, fold_out

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

        def span(first_block: int, block_count: int):
            return blocks[first_block][0], blocks[first_block + block_count - 1][1]

        distance = fold.power // 2
        while distance >= 1:
            partner = fold.real_rank(virtual ^ distance)
            group_first = (virtual // (2 * distance)) * 2 * distance
            lower_half = span(group_first, distance)
            upper_half = span(group_first + distance, distance)
            keep, give = (lower_half, upper_half) if virtual & distance == 0 else (upper_half, lower_half)
            _exchange_halves(transport, buf, op, keep, give, partner, partner < rank,
                             segment_elems, slots, f"halving distance {distance}")
            distance //= 2
        distance = 1
        while distance < fold.power:
            partner_virtual = virtual ^ distance
            partner = fold.real_rank(partner_virtual)
            mine = span((virtual // distance) * distance, distance)
            theirs = span((partner_virtual // distance) * distance, distance)
            transport.step(f"doubling distance {distance}")
            transport.exchange(((buf[mine[0]:mine[1]], partner),) if mine[1] > mine[0] else (),
                               ((buf[theirs[0]:theirs[1]], partner),) if theirs[1] > theirs[0] else ())
            distance *= 2
    fold_out(transport, fold, buf)


def _exchange_halves(transport, buf, op, keep, give, partner, partner_first, segment_elems,
                     slots, label) -> None:
    """Send ``give`` to ``partner`` and reduce the partner's copy of ``keep`` into the buffer.

    Both halves are cut into the same number of segments (the halves differ by at most one block,
    so the partner's cut of the same ranges matches ours).
    """
    segments = segment_count(max(keep[1] - keep[0], give[1] - give[0]), segment_elems)
    keep_segments = split_bounds(keep[0], keep[1], segments)
    give_segments = split_bounds(give[0], give[1], segments)
    stages = []
    for index in range(segments):
        keep_lo, keep_hi = keep_segments[index]
        give_lo, give_hi = give_segments[index]
        incoming = slots[index % len(slots)][:keep_hi - keep_lo]
        stages.append(Stage(
            f"{label} segment {index}",
            ((buf[give_lo:give_hi], partner),) if give_hi > give_lo else (),
            ((incoming, partner),) if keep_hi > keep_lo else (),
            (buf[keep_lo:keep_hi], incoming, partner_first) if keep_hi > keep_lo else None,
        ))
    run_stages(transport, stages, op, lag=len(stages))
