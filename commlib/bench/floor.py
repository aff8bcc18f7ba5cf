"""The memory floor of ``shm_twoshot``: what its arithmetic and copies alone cost on this machine.

``python -m commlib.bench --floor`` (allreduce) adds a row ``floor:twoshot``: every rank does the
loads, stores and additions the two-shot allreduce does on its buffer, the same numpy calls in
the same rounds, chunk sizes and order (:mod:`commlib.algorithms.shm.twoshot`), but on private
stand-ins for the peers' memory and without a single synchronisation. Which schedule it models
follows the buffer, as the collective's choice does:

* a symmetric buffer (``--symmetric``), the **push**: in each round the rank reduces its chunks
  from its own data and ``P - 1`` reads of a stand-in, then copies each reduced chunk back over
  the stand-in's chunk it read (``P - 1`` times), as the collective writes the peers' buffers
  where it read them. The stand-in is the benchmark's plain buffer, which the reset before
  every call has just written, as a peer's reset wrote its buffer;
* a plain buffer, the **pull**: the rank reduces its slice the same way, then fills the other
  slices by copying its own freshly reduced slice (where the collective copies the peers'
  freshly reduced ones). The staging copies are left out.

The pull's stand-in is the benchmark's pristine input, which the reset before every call has
just read, so it is as warm as a peer's freshly written buffer; the pull's copies read this
core's own recent writes, warmer than a peer's, and the push's stand-in is in this core's
cache, not a peer's: the row errs on the fast side. All ranks run
it at once, as they run the collective, so they share the machine's memory bandwidth as they
would there. It is not an allreduce (its result is not checked: ``#wrong`` is ``-``); it is a
time under which no schedule that does this memory work on these cores can go, measured in the
same run as the contenders, like ``ddp.bench``'s ``local`` row.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np

from commlib.algorithms.common.partition import rounds_last_first
from commlib.algorithms.shm.twoshot import (CHUNK_BYTES, CHUNK_BYTES_MANY, COPY_BYTES, PUSH_BYTES, chunk_spans,
                                            copy_in_pieces, interleaved_chunks, round_slices)
from commlib.ops import ReduceOp, ufunc_name

__all__ = ["FLOOR_NAME", "twoshot_floor"]

FLOOR_NAME = "floor:twoshot"


def twoshot_floor(buf: np.ndarray, standin: np.ndarray, rank: int, size: int, op: ReduceOp,
                  round_bytes: int, *, push: bool = False,
                  destinations: Optional[List[np.ndarray]] = None) -> Callable[[], None]:
    """``run()``: the two-shot's memory work on ``buf`` at rank ``rank`` of ``size``, in rounds of
    ``round_bytes`` (the staging half, as the collective), reading ``standin`` (the size of
    ``buf``) where the reduce reads a peer's memory. ``push``: the symmetric buffers' schedule,
    writing ``destinations`` (``size - 1`` arrays the size of ``buf``; by default ``standin``
    itself, which it then overwrites) where the collective writes the peers' buffers."""
    combine = getattr(np, ufunc_name(op if op is not ReduceOp.AVG else ReduceOp.SUM))
    if push:
        return _push_floor(buf, standin, rank, size, combine, round_bytes, destinations)
    itemsize = buf.dtype.itemsize
    chunk_elems = max(1, (CHUNK_BYTES if size == 2 else CHUNK_BYTES_MANY) // itemsize)
    copy_elems = max(1, COPY_BYTES // itemsize)
    round_elems = max(size, round_bytes // itemsize)
    rounds = []
    for start, stop in rounds_last_first(buf.size, round_elems):  # in the collective's order
        piece, other = buf[start:stop], standin[start:stop]
        slices = round_slices(piece.size, size)
        mine_lo, mine_hi = slices[rank]
        # Each other slice is filled from this rank's own: (destination lo, hi, source lo) pieces,
        # the own slice again for the element a longer slice has beyond it.
        mine_count = mine_hi - mine_lo
        copies = []  # (destination, source) views of equal length
        for peer, (lo, hi) in enumerate(slices):
            for first in range(lo, hi, mine_count) if peer != rank and mine_count else ():
                count = min(mine_count, hi - first)
                copies.append((piece[first:first + count], piece[mine_lo:mine_lo + count]))
        rounds.append((piece, other, chunk_spans((mine_lo, mine_hi), chunk_elems), copies))
    reads = max(1, size - 1)

    def run() -> None:
        for piece, other, chunks, copies in rounds:
            for lo, hi in chunks:
                _reduce_from(piece[lo:hi], other[lo:hi], reads, combine)
            for destination, source in copies:  # in the two-shot's cache-sized pieces
                copy_in_pieces(destination, source, 0, destination.size, copy_elems)

    return run


def _push_floor(buf: np.ndarray, standin: np.ndarray, rank: int, size: int, combine, round_bytes: int,
                destinations: Optional[List[np.ndarray]]) -> Callable[[], None]:
    itemsize = buf.dtype.itemsize
    copy_elems = max(1, COPY_BYTES // itemsize)
    round_elems = max(size, round_bytes // itemsize)
    if destinations is None:
        destinations = [standin] * (size - 1)
    rounds = []
    for start, stop in rounds_last_first(buf.size, round_elems):
        rounds.append((buf[start:stop], standin[start:stop], [out[start:stop] for out in destinations],
                       interleaved_chunks(stop - start, rank, size, PUSH_BYTES // itemsize)))
    reads = max(1, size - 1)

    def run() -> None:
        for piece, other, outs, chunks in rounds:
            for lo, hi in chunks:
                _reduce_from(piece[lo:hi], other[lo:hi], reads, combine)
                for destination in outs:
                    copy_in_pieces(destination, piece, lo, hi, copy_elems)

    return run


def _reduce_from(out: np.ndarray, standin: np.ndarray, reads: int, combine) -> None:
    """The reduce of one chunk: ``reads`` times ``out = combine(out, standin)``, where the
    collective combines the ``P - 1`` peers' chunks."""
    for _ in range(reads):
        combine(out, standin, out=out)
