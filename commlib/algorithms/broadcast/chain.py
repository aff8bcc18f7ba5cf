"""``chain`` broadcast: the buffer flows segment by segment along a chain of all ranks.

Relative rank ``v`` (see :mod:`.binomial`) receives from ``v - 1`` and forwards to ``v + 1``.
The buffer is cut into **segments** of at most ``segment_bytes``; a rank forwards segment ``i``
as soon as it arrived, while segments ``i + 1 ..`` are already on their way to it, so all links
of the chain carry different segments at once. Invariant: a rank forwards only segments it
holds, in order, so rank ``v`` holds segments ``0 .. i`` once it forwarded segment ``i``.

Cost (alpha-beta), ``S`` segments: ``(p - 2 + S)(alpha + n/S beta)``; for ``S >> p`` about
``n beta``, independent of ``p`` (every rank receives and sends the buffer once), at the price
of ``p - 2 + S`` latencies: the large-message broadcast. No extra memory.
"""

from __future__ import annotations

from commlib.algorithms.common.binomial import real_rank, relative_rank
from commlib.algorithms.common.forward import forward_segments
from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.common.pipeline import PIPELINE_WINDOW

__all__ = ["broadcast_chain"]


def broadcast_chain(transport, buf, root: int, *, segment_bytes: int = 1 << 20) -> None:
    size = transport.size
    if size == 1 or buf.size == 0:
        return
    relative = relative_rank(transport.rank, root, size)
    predecessor = real_rank(relative - 1, root, size) if relative > 0 else -1
    successors = [real_rank(relative + 1, root, size)] if relative + 1 < size else []
    segment_elems = segment_elements(segment_bytes, buf.itemsize)
    segments = split_bounds(0, buf.size, segment_count(buf.size, segment_elems))
    forward_segments(transport, buf, segments, predecessor, successors, PIPELINE_WINDOW, "chain broadcast")
