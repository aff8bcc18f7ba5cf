"""``recursive_doubling``: ``log2 p`` rounds of whole-buffer exchange and reduce.

In round ``m = 1, 2, 4, ...`` virtual rank ``v`` exchanges its whole buffer with ``v xor m``
and combines the two. Invariant: after the round with distance ``m``, every rank holds the
reduction over its aligned group of ``2m`` virtual ranks. Partners evaluate the very same
expression (the lower rank's operand first), so all ranks end with identical bytes. A
non-power-of-two world is folded first (see :mod:`.power_of_two`).

Cost (alpha-beta): ``log2 p (alpha + n beta)`` plus ``n log2 p`` local reduces (+ two steps of
``n`` on folded pairs): latency-optimal, so it wins for small messages; its bandwidth term is
``log2 p`` times the ring's. Each round is cut into **segments** that are reduced while the next
ones are in flight; extra memory: ``window + 1`` segments.
"""

from __future__ import annotations

from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import PIPELINE_WINDOW, Stage, run_stages, scratch_slots
from commlib.algorithms.common.power_of_two import Fold, fold_in, fold_out
from commlib.ops import ReduceOp

__all__ = ["allreduce_recursive_doubling"]


def allreduce_recursive_doubling(transport, buf, op: ReduceOp, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    if size == 1 or buf.size == 0:
        return
    fold = Fold(size, rank)
    fold_in(transport, fold, buf, op, segment_bytes)
    if fold.virtual_rank >= 0:
        segment_elems = segment_elements(segment_bytes, buf.itemsize)
        segments = split_bounds(0, buf.size, segment_count(buf.size, segment_elems))
        slots = scratch_slots(transport, segments[0][1] - segments[0][0], buf.dtype)
        distance = 1
        while distance < fold.power:
            partner = fold.real_rank(fold.virtual_rank ^ distance)
            partner_first = partner < rank
            stages = []
            for index, (lo, hi) in enumerate(segments):
                incoming = slots[index % len(slots)][:hi - lo]
                stages.append(Stage(f"recursive doubling distance {distance} segment {index}",
                                    ((buf[lo:hi], partner),), ((incoming, partner),),
                                    (buf[lo:hi], incoming, partner_first)))
            # Within a round the segments are independent; rounds run one after the other.
            run_stages(transport, stages, op, lag=len(stages), window=PIPELINE_WINDOW)
            distance *= 2
    fold_out(transport, fold, buf)
