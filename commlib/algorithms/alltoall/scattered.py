"""``scattered`` alltoall and alltoallv: every block in flight at once, in one step.

``inp`` holds one **block** per destination and ``out`` one per source, in rank order (equal
blocks, or the counts' prefix sums as displacements). Rank ``r`` posts all its ``p - 1`` sends
and receives, copies its own block while they are in flight, and waits for all. Invariant: each
block of ``out`` is written by exactly one receive (or the own copy).

Cost (alpha-beta): ``alpha + (p-1) b beta`` if a rank's link serialises its transfers; every
pair's transfer may proceed at once, so nothing waits on a round boundary. On one host over
shared memory the receivers copy, so the ``p - 1`` copies spread over the cores (MPICH's own
choice for medium messages; faster than ``MPI_Alltoall`` and pairwise from a few MiB at 4 ranks:
docs/benchmarks/collectives-alltoall-p4). Across a
network of many ranks, flooding one receiver with ``p - 1`` messages is what pairwise avoids.
Empty blocks are not sent. No extra memory.
"""

from __future__ import annotations

from commlib.algorithms.common.partition import displacements

__all__ = ["alltoall_scattered", "alltoallv_scattered"]


def alltoall_scattered(transport, out, inp, *, segment_bytes: int = 1 << 20) -> None:
    counts = (inp.size // transport.size,) * transport.size
    alltoallv_scattered(transport, out, inp, counts, counts, segment_bytes=segment_bytes)


def alltoallv_scattered(transport, out, inp, out_counts, in_counts, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    out_offsets, in_offsets = displacements(out_counts), displacements(in_counts)
    sends = [(inp[in_offsets[peer]:in_offsets[peer + 1]], peer) for peer in range(size)
             if peer != rank and in_counts[peer]]
    recvs = [(out[out_offsets[peer]:out_offsets[peer + 1]], peer) for peer in range(size)
             if peer != rank and out_counts[peer]]
    transport.step("scattered")
    pending = transport.post(sends, recvs)
    transport.copy(out[out_offsets[rank]:out_offsets[rank + 1]], inp[in_offsets[rank]:in_offsets[rank + 1]])
    pending.wait()
