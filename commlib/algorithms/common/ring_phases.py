"""Ring reduce-scatter and ring allgather over chunks of any sizes: the halves of a ring allreduce.

``chunks[i]`` is the ``[start, stop)`` span of the flat buffer that rank ``i`` ends up owning;
chunks may differ in size (a host with fewer ranks than shards gives some ranks several) and
may be empty. Rank ``r`` sends only to ``r + 1`` and receives only from ``r - 1``.

* :func:`ring_reduce_scatter`, steps ``s = 0 .. p-2``: send chunk ``r - s - 1``, receive chunk
  ``r - s - 2`` into a scratch segment and reduce it into the buffer. Invariant: after step
  ``s`` the buffer's chunk ``r - s - 2`` holds the partial result of ranks ``r - s - 2 .. r``;
  after ``p - 1`` steps rank ``r`` holds chunk ``r`` reduced over every rank (the plain ring of
  :mod:`.ring` ends one chunk further on; here each rank must own *its* chunk).
  Cost: ``(p-1)(alpha + c beta)`` for chunks of ``c`` elements, plus ``(p-1) c`` reduces;
  segments of at most ``segment_bytes`` pipeline the reduce with the next transfers.
* :func:`ring_allgather`, steps ``t = 0 .. p-2``: send chunk ``r - t``, receive chunk
  ``r - t - 1`` straight into the buffer (whole chunks: nothing to overlap). Cost
  ``(p-1)(alpha + c beta)``. Every rank ends with the owner's bytes of every chunk.
"""

from __future__ import annotations

from typing import List, Sequence

from commlib.algorithms.common.partition import Span, segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import Stage, run_stages, scratch_slots
from commlib.ops import ReduceOp

__all__ = ["ring_reduce_scatter", "ring_allgather"]


def ring_reduce_scatter(transport, buf, op: ReduceOp, chunks: Sequence[Span], *,
                        segment_bytes: int, label: str = "ring reduce-scatter") -> None:
    size, rank = transport.size, transport.rank
    if size == 1:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    longest = max(stop - start for start, stop in chunks)
    if longest == 0:
        return
    segments_per_chunk = segment_count(longest, segment_elements(segment_bytes, buf.itemsize))
    chunk_segments = [split_bounds(start, stop, segments_per_chunk) for start, stop in chunks]
    slots = scratch_slots(transport, -(-longest // segments_per_chunk), buf.dtype)
    stages: List[Stage] = []
    for step in range(size - 1):
        send_chunk, recv_chunk = (rank - step - 1) % size, (rank - step - 2) % size
        for segment in range(segments_per_chunk):
            send_lo, send_hi = chunk_segments[send_chunk][segment]
            recv_lo, recv_hi = chunk_segments[recv_chunk][segment]
            incoming = slots[len(stages) % len(slots)][:recv_hi - recv_lo]
            stages.append(Stage(
                f"{label} step {step} segment {segment}",
                ((buf[send_lo:send_hi], right),) if send_hi > send_lo else (),
                ((incoming, left),) if recv_hi > recv_lo else (),
                (buf[recv_lo:recv_hi], incoming, False) if recv_hi > recv_lo else None,
            ))
    run_stages(transport, stages, op, lag=segments_per_chunk)


def ring_allgather(transport, buf, chunks: Sequence[Span], *, label: str = "ring allgather") -> None:
    size, rank = transport.size, transport.rank
    if size == 1:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    for step in range(size - 1):
        send_lo, send_hi = chunks[(rank - step) % size]
        recv_lo, recv_hi = chunks[(rank - step - 1) % size]
        transport.step(f"{label} step {step}")
        transport.exchange(((buf[send_lo:send_hi], right),) if send_hi > send_lo else (),
                           ((buf[recv_lo:recv_hi], left),) if recv_hi > recv_lo else ())
