"""``pairwise`` alltoall and alltoallv: ``p - 1`` rounds, one partner to send to and one to hear from.

``inp`` holds one **block** per destination rank and ``out`` one per source rank, in rank order
(alltoall: equal blocks; alltoallv: the counts' prefix sums are the displacements). Rank ``r``
first copies its block for itself; in round ``s = 1 .. p-1`` it sends its block for ``r + s`` to
``r + s`` and receives from ``r - s`` that rank's block for ``r`` straight into ``out`` (for a
power-of-two ``p`` the partner is ``r xor s`` both ways, so each round pairs ranks off).
Invariant: after round ``s``, ``out`` holds the blocks of ``r`` and the ``s`` ranks heard from.

Cost (alpha-beta): ``(p-1)(alpha + b beta)`` for blocks of ``b`` elements: each round moves one
block each way per rank, so no rank is flooded by ``p - 1`` senders at once: the large-block
alltoall. Empty blocks are not sent. No extra memory.
"""

from __future__ import annotations

from commlib.algorithms.common.partition import displacements
from commlib.algorithms.reduce_scatter.pairwise import pairwise_partners

__all__ = ["alltoall_pairwise", "alltoallv_pairwise"]


def alltoall_pairwise(transport, out, inp, *, segment_bytes: int = 1 << 20) -> None:
    counts = (inp.size // transport.size,) * transport.size
    alltoallv_pairwise(transport, out, inp, counts, counts, segment_bytes=segment_bytes)


def alltoallv_pairwise(transport, out, inp, out_counts, in_counts, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    out_offsets, in_offsets = displacements(out_counts), displacements(in_counts)
    transport.copy(out[out_offsets[rank]:out_offsets[rank + 1]], inp[in_offsets[rank]:in_offsets[rank + 1]])
    for round_ in range(1, size):
        destination, source = pairwise_partners(rank, size, round_)
        sends = (((inp[in_offsets[destination]:in_offsets[destination + 1]], destination),)
                 if in_counts[destination] else ())
        recvs = (((out[out_offsets[source]:out_offsets[source + 1]], source),)
                 if out_counts[source] else ())
        if sends or recvs:
            transport.step(f"pairwise round {round_}")
            transport.exchange(sends, recvs)
