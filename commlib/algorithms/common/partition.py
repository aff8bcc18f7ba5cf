"""Chunk and segment arithmetic shared by the schedules.

Terms used by every algorithm file:

* a **chunk** is the part of the buffer one rank is responsible for in a reduce-scatter (ring:
  ``p`` chunks; rabenseifner: one *block* per participating rank);
* a **segment** is the unit of one transfer: a chunk (or a whole buffer) cut into pieces of at
  most ``segment_bytes``, so a received piece can be reduced while the next is in flight and the
  scratch memory stays one small, cache-resident piece per slot.

Splits are near-equal and deterministic: every rank computes the same bounds from
``(count, parts)`` alone, so a piece that is empty on one side is empty on the other and both
skip it.
"""

from __future__ import annotations

from typing import List, Tuple

__all__ = ["split_bounds", "segment_elements", "segment_count", "displacements", "rounds_last_first", "Span"]

Span = Tuple[int, int]  # [start, stop) in elements of the flat buffer


def rounds_last_first(count: int, round_elems: int) -> List[Span]:
    """``[0, count)`` in back-to-back spans of at most ``round_elems``, the last one first.

    For the shared-memory allreduces, whose rounds may go in any order as long as every rank
    takes the same: a buffer is most often written front to back just before the call, so its
    end is what is still in cache, and a pass from the front would evict it before getting
    there (measured in :mod:`.shm_twoshot`)."""
    return [(start, min(start + round_elems, count)) for start in range(0, count, round_elems)][::-1]


def split_bounds(start: int, stop: int, parts: int) -> List[Span]:
    """``[start, stop)`` cut into ``parts`` contiguous spans whose sizes differ by at most one.

    The first ``(stop - start) % parts`` spans get the extra element; spans may be empty.
    """
    count = stop - start
    base, extra = divmod(count, parts)
    spans = []
    offset = start
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        spans.append((offset, offset + size))
        offset += size
    return spans


def segment_elements(segment_bytes: int, itemsize: int) -> int:
    """Elements per segment for a ``segment_bytes`` knob (at least one element)."""
    return max(1, int(segment_bytes) // itemsize)


def segment_count(elements: int, segment_elems: int) -> int:
    """How many segments a span of ``elements`` needs (at least one, even when empty)."""
    return max(1, -(-elements // segment_elems))


def displacements(counts) -> List[int]:
    """Where each block starts when blocks of ``counts`` elements lie back to back, plus the end
    (``len(counts) + 1`` offsets): block ``i`` is ``[d[i], d[i + 1])`` (alltoallv's layout)."""
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets
