"""``pairwise`` reduce_scatter: in each of ``p - 1`` rounds every rank swaps blocks with one partner.

``inp`` holds one **block** per rank. In round ``s = 1 .. p-1`` rank ``r`` sends its input block
for rank ``r + s`` to ``r + s`` and receives rank ``r - s``'s input block for ``r``, which it
combines into ``out`` (for a power-of-two ``p`` the partner is ``r xor s`` both ways, so each
round pairs ranks off). Invariant: after round ``s``, ``out`` holds block ``r`` reduced over
``r`` and the ``s`` ranks it heard from. Each round is cut into **segments** reduced while the
next are in flight; the first round lands in ``out`` directly.

Cost (alpha-beta): ``(p-1)(alpha + n/p beta + n/p gamma)`` for an input of ``n`` elements, like
the ring, but every transfer is direct (no partial is forwarded), so a slow rank delays only its
partners. Extra memory: ``w + 1`` segments.
"""

from __future__ import annotations

from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import PIPELINE_WINDOW, Stage, run_stages, scratch_slots
from commlib.ops import ReduceOp

__all__ = ["reduce_scatter_pairwise", "pairwise_partners"]


def pairwise_partners(rank: int, size: int, round_: int):
    """``(send to, receive from)`` in round ``round_`` (1 .. size-1) of a pairwise exchange."""
    if size & (size - 1) == 0:
        partner = rank ^ round_
        return partner, partner
    return (rank + round_) % size, (rank - round_) % size


def reduce_scatter_pairwise(transport, out, inp, op: ReduceOp, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    block = out.size
    own = inp[rank * block:(rank + 1) * block]
    if size == 1 or block == 0:
        transport.copy(out, own)
        return
    segments = split_bounds(0, block, segment_count(block, segment_elements(segment_bytes, out.itemsize)))
    slots = scratch_slots(transport, segments[0][1] - segments[0][0], out.dtype)
    stages = []
    for round_ in range(1, size):
        destination, source = pairwise_partners(rank, size, round_)
        sending = inp[destination * block:(destination + 1) * block]
        for index, (lo, hi) in enumerate(segments):
            label = f"pairwise round {round_} segment {index}"
            if round_ == 1:
                stages.append(Stage(label, ((sending[lo:hi], destination),), ((out[lo:hi], source),),
                                    (out[lo:hi], own[lo:hi], True)))
            else:
                incoming = slots[len(stages) % len(slots)][:hi - lo]
                stages.append(Stage(label, ((sending[lo:hi], destination),), ((incoming, source),),
                                    (out[lo:hi], incoming, False)))
    run_stages(transport, stages, op, lag=len(stages), window=PIPELINE_WINDOW)
