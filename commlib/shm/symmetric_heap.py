"""Where symmetric buffers live: the same offsets in every rank's shared-memory segment.

A **symmetric buffer** is one allocation made collectively: every rank of the group gets an
array at the *same offset* of its own segment, so a rank that knows where its own buffer is
knows where every peer's is. This module is the bookkeeping only (pure Python, no MPI, no
memory): a first-fit list of free ``[offset, offset + nbytes)`` ranges over the heap part of a
segment, identical on every rank as long as every rank makes the same calls in the same order.

Allocating is collective (the group checks that every rank asked for the same bytes). Freeing is
not: a buffer is released when its last reference dies on a rank, which may happen at different
times on different ranks. So a release is only *recorded* (:meth:`SymmetricHeap.release`), and
the range goes back to the free list at the next collective allocation, once every rank has
released it (:meth:`reclaim` with the ranks' flags combined by a MIN): the free lists stay
identical without any rank waiting for another. A rank gives its own pages back to the system
at once when it releases (they are not read any more: a collective on a buffer holds a
reference to it until its peers finished reading it).
"""

from __future__ import annotations

import threading
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["SymmetricHeap", "Region"]


class Region(NamedTuple):
    serial: int   # allocation number, the same on every rank
    offset: int   # in the segment
    nbytes: int   # as reserved (a multiple of the alignment)


class SymmetricHeap:
    def __init__(self, start: int, end: int, alignment: int = 4096):
        if start % alignment or end < start:
            raise ValueError(f"SymmetricHeap: [{start}, {end}) not aligned to {alignment}")
        self.start, self.end, self.alignment = start, end, alignment
        self._free: List[Tuple[int, int]] = [(start, end - start)]  # (offset, nbytes), sorted
        self._live: Dict[int, Region] = {}  # serial -> region, in allocation order
        self._released: set = set()  # serials released on this rank, not yet reclaimed
        self._serial = 0
        self._lock = threading.Lock()  # releases come from finalizers, on any thread

    # -- on every rank alike (collective callers) ----------------------------------------------
    def live_serials(self) -> List[int]:
        with self._lock:
            return list(self._live)

    def released_flags(self, serials: Sequence[int]) -> List[int]:
        """1 for each of ``serials`` this rank has released, else 0 (to be MIN-combined)."""
        with self._lock:
            return [1 if serial in self._released else 0 for serial in serials]

    def reclaim(self, serials: Sequence[int], released_everywhere: Sequence[int]) -> int:
        """Return to the free list the ``serials`` whose combined flag is 1; the bytes reclaimed."""
        reclaimed = 0
        with self._lock:
            for serial, everywhere in zip(serials, released_everywhere):
                if everywhere:
                    region = self._live.pop(serial)
                    self._released.discard(serial)
                    self._insert_free(region.offset, region.nbytes)
                    reclaimed += region.nbytes
        return reclaimed

    def place(self, nbytes: int) -> Optional[Region]:
        """First fit for ``nbytes`` (at least one alignment unit); None when nothing fits."""
        size = max(self.alignment, -(-nbytes // self.alignment) * self.alignment)
        with self._lock:
            for index, (offset, free) in enumerate(self._free):
                if free >= size:
                    if free == size:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + size, free - size)
                    self._serial += 1
                    region = Region(self._serial, offset, size)
                    self._live[region.serial] = region
                    return region
        return None

    def undo(self, region: Region) -> None:
        """Forget ``region`` at once (an allocation that failed on some rank)."""
        with self._lock:
            if self._live.pop(region.serial, None) is not None:
                self._released.discard(region.serial)
                self._insert_free(region.offset, region.nbytes)

    # -- on one rank -----------------------------------------------------------------------------
    def release(self, serial: int) -> None:
        """This rank holds no reference to the region any more (called from a finalizer)."""
        with self._lock:
            if serial in self._live:
                self._released.add(serial)

    # -- introspection ---------------------------------------------------------------------------
    def free_bytes(self) -> int:
        with self._lock:
            return sum(free for _offset, free in self._free)

    def largest_free(self) -> int:
        with self._lock:
            return max((free for _offset, free in self._free), default=0)

    def live_bytes(self) -> int:
        with self._lock:
            return sum(region.nbytes for region in self._live.values())

    def _insert_free(self, offset: int, nbytes: int) -> None:
        """Insert and merge with the neighbours (caller holds the lock)."""
        free = self._free
        index = 0
        while index < len(free) and free[index][0] < offset:
            index += 1
        free.insert(index, (offset, nbytes))
        if index + 1 < len(free) and offset + nbytes == free[index + 1][0]:
            free[index] = (offset, nbytes + free[index + 1][1])
            del free[index + 1]
        if index > 0 and free[index - 1][0] + free[index - 1][1] == offset:
            free[index - 1] = (free[index - 1][0], free[index - 1][1] + free[index][1])
            del free[index]
