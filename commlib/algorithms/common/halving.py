"""Recursive halving: the reduce-scatter of rabenseifner's allreduce and reduce, and of the
``recursive_halving`` reduce_scatter.

``power`` virtual ranks (a power of two; see :mod:`.power_of_two` for folding the rest) each own
one **block**, a span of the work buffer. At distance ``m = power/2 .. 1`` virtual rank ``v``
owns a contiguous range of ``2m`` blocks; it keeps the half that contains block ``v``, sends the
other half to ``v xor m`` and reduces the half it receives into its own, the lower virtual
rank's operand first. Invariant: after distance ``m``, ``v``'s aligned ``m`` blocks hold the
reduction over its aligned group of ``power/m`` virtual ranks; at the end block ``v`` holds the
reduction over all. Each exchange is cut into **segments**, reduced while the next are in flight.

Cost: ``log2 power`` steps moving ``n (power-1)/power`` elements and reducing as many.

The first exchange may read a separate, read-only ``source`` (reduce and reduce_scatter must not
write their input): then the partner's half is received straight into ``work`` and combined with
the source's, so nothing is copied into ``work`` beforehand.
"""

from __future__ import annotations

from commlib.algorithms.common.partition import segment_count, split_bounds
from commlib.algorithms.common.pipeline import Stage, run_stages

__all__ = ["recursive_halving", "block_span"]


def block_span(blocks, first_block: int, block_count: int):
    """The element span ``[start, stop)`` of ``block_count`` blocks from ``first_block``."""
    return blocks[first_block][0], blocks[first_block + block_count - 1][1]


def recursive_halving(transport, work, op, *, virtual: int, power: int, real_rank, blocks,
                      segment_elems: int, slots, source=None, label: str = "halving") -> None:
    """Reduce-scatter ``work`` (or ``source``, then ``work``) over ``power`` virtual ranks.

    ``real_rank(v)`` maps a virtual rank to a transport rank; ``blocks[v]`` is virtual rank
    ``v``'s span of ``work``; ``slots`` are receive slots of ``segment_elems`` elements.
    """
    distance = power // 2
    while distance >= 1:
        partner_virtual = virtual ^ distance
        group_first = (virtual // (2 * distance)) * 2 * distance
        lower_half = block_span(blocks, group_first, distance)
        upper_half = block_span(blocks, group_first + distance, distance)
        keep, give = (lower_half, upper_half) if virtual & distance == 0 else (upper_half, lower_half)
        _exchange_halves(transport, work, source, op, keep, give, real_rank(partner_virtual),
                         partner_virtual < virtual, segment_elems, slots, f"{label} distance {distance}")
        source = None
        distance //= 2


def _exchange_halves(transport, work, source, op, keep, give, partner, partner_first,
                     segment_elems, slots, label) -> None:
    """Send ``give`` to ``partner``; reduce the partner's copy of ``keep`` into ``work``.

    Both halves are cut into the same number of segments (the halves differ by at most one block,
    so the partner's cut of the same ranges matches ours).
    """
    segments = segment_count(max(keep[1] - keep[0], give[1] - give[0]), segment_elems)
    keep_segments = split_bounds(keep[0], keep[1], segments)
    give_segments = split_bounds(give[0], give[1], segments)
    sender = work if source is None else source
    stages = []
    for index in range(segments):
        keep_lo, keep_hi = keep_segments[index]
        give_lo, give_hi = give_segments[index]
        sends = ((sender[give_lo:give_hi], partner),) if give_hi > give_lo else ()
        if keep_hi == keep_lo:
            stages.append(Stage(f"{label} segment {index}", sends, ()))
        elif source is None:
            incoming = slots[index % len(slots)][:keep_hi - keep_lo]
            stages.append(Stage(f"{label} segment {index}", sends, ((incoming, partner),),
                                (work[keep_lo:keep_hi], incoming, partner_first)))
        else:  # the partner's operand lands in work; ours is the source's
            stages.append(Stage(f"{label} segment {index}", sends, ((work[keep_lo:keep_hi], partner),),
                                (work[keep_lo:keep_hi], source[keep_lo:keep_hi], not partner_first)))
    run_stages(transport, stages, op, lag=len(stages))
