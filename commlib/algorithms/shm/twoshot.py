"""``shm_twoshot``: reduce-scatter, then allgather, both straight in the ranks' shared memory.

Needs a transport with direct access to its peers' memory (the ranks of one host, see
:mod:`commlib.transports.shm`). Terms: a **round** is one pass over at most a staging half's
worth of the buffer (each round is a collective of its own: its own epoch); a round is cut into
**chunks** small enough that a chunk and its partial result stay in cache.

Where a rank's data is: a **symmetric** buffer (``ProcessGroup.alloc``) already lives in its
segment and is offered in place (zero copy); a plain buffer's round is first copied to the
rank's staging half, except its own slice, which only it reads.

One round begins with *arrive*: publish where the round's data is, wait until every rank has.
Then one of two schedules, chosen alike on every rank from the offers:

**Push** (every rank's buffer symmetric, and the peers' heaps writable here): rank ``r`` takes
every ``P``-th chunk of the round from chunk ``r`` on, last first (interleaved, so that every
rank gets as much of the freshly written and of the older part of a buffer). For each chunk it
combines its own contribution with the peers' (rotated: ranks ``r + 1, r + 2, ...``) into its
own buffer (AVG divides there) and writes the result into every peer's buffer while the chunk is
still in its cache. Then *depart* (DONE, after a fence), and before returning, wait until every peer has
departed: then every chunk of this rank's buffer has been written. No counter per chunk.

**Pull** (any plain buffer): the round is cut into ``P`` **slices**, rank ``r`` owning slice
``r``.

1. *Reduce-scatter*: rank ``r`` reduces slice ``r`` chunk by chunk as above, into its own memory,
   and publishes PROGRESS after every chunk.
2. *Allgather*: rank ``r`` copies slice ``j`` from rank ``j``, chunk by chunk as ``j``'s
   PROGRESS covers it (peers in rotated order), in cache-sized pieces.
3. *Depart*: publish DONE. A symmetric buffer waits, before returning, until every peer has
   departed (the caller may write its buffer next); staging defers that wait to the staging
   half's next use.

Invariants: each chunk is computed by one rank alone and copied from it by everyone else, so
every rank ends with the same bytes. A rank writes peer-visible memory only where no peer reads
any more: in the push, only the chunks it computes, which no other rank reads or writes in that
round; in the pull, its own slice, which peers read only after PROGRESS covers it, and the other
slices, which rank ``j`` has read (in step 1) before its PROGRESS covered them.

Cost per rank for ``n`` bytes at P = 2: the push reads both contributions of its ``n/2`` and
writes them twice, the least an in-place allreduce can do (each buffer read once and written
once); the pull reads ``n/2`` more (the peer's reduced slice), and was about 1.4x the push's time
at 64 MiB. A plain buffer adds one staging copy of ``(P-1)/P n`` and one of ``n/P`` (at 64 MiB
and P = 2 that makes it slower than the ring). Data: docs/benchmarks/shm-allreduce-p2, whose
floor row is the same loads, stores and adds with no synchronisation at all.

Order: the rounds go last first, and so do a rank's push chunks. A buffer is most often
written front to back just before the call (a copy, a numpy result, a DDP bucket whose gradients
are laid out in the order backward produces them), so its end is what is still in cache; a sweep
from the front would evict that end (the oldest lines cached) before it got there. Last first
was faster at every size from 1 to 64 MiB in interleaved runs (by 5-25%). The pull's slices stay
front first (its PROGRESS counts a slice's chunks in order).

``slice_hook`` (for a hierarchical allreduce): called with each round's reduced slice of this
rank (an array in this rank's memory) before anyone may copy it, e.g. to allreduce it with the
ranks of other hosts in place; the allgather (or the push, of the whole slice after the hook)
then spreads the hook's result.
"""

from __future__ import annotations

from typing import Callable, List, NamedTuple, Optional, Tuple

from commlib.algorithms.common.partition import Span, rounds_last_first, split_bounds
from commlib.ops import ReduceOp, ufunc_name
from commlib.transports.shm.layout import kind_code

__all__ = ["allreduce_shm_twoshot", "round_slices", "chunk_spans", "reduce_order", "gather_order",
           "copy_in_pieces", "interleaved_chunks", "CHUNK_BYTES", "PUSH_BYTES"]

# The pull's sizes. A reduce chunk of 1-4 MiB costs the Python per chunk little and stays in the
# shared cache (256 KiB chunks were ~10% slower, one call no faster); with P > 2 a chunk is
# combined P - 1 times and should stay in L2 (CHUNK_BYTES_MANY). The copies go in pieces of a
# few hundred KiB: one large copy takes glibc's non-temporal path, which was ~1.5x slower here.
# Copying each peer chunk right after it was published, while in the shared cache, was no faster.
CHUNK_BYTES = 1 << 20
CHUNK_BYTES_MANY = 512 << 10
COPY_BYTES = 256 << 10
# The push's chunk: reduced, then copied to every peer while in L2 (1 MiB chunks were ~15% slower:
# the copy then reads them back from L3).
PUSH_BYTES = 256 << 10


def round_slices(count: int, size: int) -> List[Span]:
    return split_bounds(0, count, size)


def chunk_spans(span: Span, chunk_elems: int) -> List[Span]:
    lo, hi = span
    return [(start, min(start + chunk_elems, hi)) for start in range(lo, hi, chunk_elems)]


def reduce_order(rank: int, size: int) -> List[int]:
    """Whose contributions rank ``rank`` combines into its slice, in order: its own first."""
    return [(rank + step) % size for step in range(size)]


def gather_order(rank: int, size: int) -> List[int]:
    """Whose slices rank ``rank`` copies, in order."""
    return [(rank + step) % size for step in range(1, size)]


class _Round(NamedTuple):
    """One round's fixed arithmetic (see the module docstring), derived once per buffer shape."""

    start: int  # the round's first element
    stop: int
    slices: List[Span]  # of the round, rank by rank
    mine: List[Span]  # this rank's slice in chunks
    others: List[Tuple[int, List[Span]]]  # (peer, its slice in chunks) in gather order
    pushed: List[Span]  # the chunks this rank reduces and pushes: every P-th from its rank on, last first


def _plan(transport, count: int, itemsize: int, segment_bytes: int) -> Tuple[List[_Round], int]:
    """``(rounds, copy_elems)`` for ``count`` elements of ``itemsize`` bytes: the same on every call
    with the same shape, so kept in ``transport.memo`` (round_slices, chunk_spans and the orders
    were 2.5 us of a 1 MiB allreduce's ~40)."""
    key = ("shm_twoshot", count, itemsize, segment_bytes)
    plan = transport.memo.get(key)
    if plan is None:
        size, rank = transport.size, transport.rank
        chunk_elems = max(1, min(segment_bytes, CHUNK_BYTES if size == 2 else CHUNK_BYTES_MANY) // itemsize)
        round_elems = max(size, transport.layout.staging_bytes // itemsize)
        push_elems = min(segment_bytes, PUSH_BYTES) // itemsize
        rounds = []
        for start, stop in rounds_last_first(count, round_elems):
            slices = round_slices(stop - start, size)
            rounds.append(_Round(start, stop, slices, chunk_spans(slices[rank], chunk_elems),
                                 [(peer, chunk_spans(slices[peer], chunk_elems)) for peer in gather_order(rank, size)],
                                 interleaved_chunks(stop - start, rank, size, push_elems)))
        if len(transport.memo) > 256:
            transport.memo.clear()
        plan = transport.memo[key] = (rounds, max(1, min(segment_bytes, COPY_BYTES) // itemsize))
    return plan


def allreduce_shm_twoshot(transport, buf, op: ReduceOp, *, segment_bytes: int = CHUNK_BYTES,
                          slice_hook: Optional[Callable[[object], None]] = None) -> None:
    size, rank = transport.size, transport.rank
    if size == 1 or buf.size == 0:
        if slice_hook is not None and buf.size:
            slice_hook(buf)
        return
    dtype = buf.dtype
    itemsize = dtype.itemsize
    combine = getattr(transport.xp, ufunc_name(op))  # AVG: a sum, divided per chunk
    kind = kind_code(dtype, op)
    total_bytes = buf.nbytes
    rounds, copy_elems = _plan(transport, buf.size, itemsize, segment_bytes)
    in_place = transport.locate(buf)  # None: a plain buffer, staged
    order = reduce_order(rank, size)
    epoch = 0
    pushed_any = False
    for start, stop, slices, mine_chunks, others, pushed in rounds:
        piece = buf[start:stop]
        epoch = transport.begin()
        if in_place is not None:
            offset, mine = in_place + start * itemsize, piece
        else:
            offset, staging = transport.claim_staging(epoch)
            mine = staging[:piece.nbytes].view(dtype)
            for peer, _ in others:  # what the peers will read of this rank's data
                lo, hi = slices[peer]
                copy_in_pieces(mine, piece, lo, hi, copy_elems)
        transport.arrive(epoch, offset, piece.nbytes, kind, total_bytes)
        offsets = transport.offers(epoch, piece.nbytes, kind, total_bytes)
        if transport.may_push(epoch, offsets):  # every rank's buffer symmetric: push
            _reduce_and_push(transport.writable_arrays(offsets, piece.size, dtype), order,
                             pushed if slice_hook is None else mine_chunks, combine, op, size, copy_elems,
                             slice_hook, slices[rank])
            pushed_any = True
            transport.depart(wrote=True)
            continue
        data = transport.offered_arrays(offsets, piece.size, dtype)
        for index, (lo, hi) in enumerate(mine_chunks):
            # This rank's own contribution first, wherever it lives (in place: mine itself).
            _reduce_chunk(mine[lo:hi], piece[lo:hi], data, order[1:], lo, hi, combine, op, size)
            if slice_hook is None:
                if in_place is None:
                    copy_in_pieces(piece, mine, lo, hi, copy_elems)
                transport.publish_progress(epoch, index + 1)
        if slice_hook is not None:
            lo, hi = slices[rank]
            slice_hook(mine[lo:hi])
            if in_place is None:
                copy_in_pieces(piece, mine, lo, hi, copy_elems)
            transport.publish_progress(epoch, len(mine_chunks))
        for peer, spans in others:
            source = data[peer]
            for index, (lo, hi) in enumerate(spans):
                transport.wait_progress(peer, epoch, index + 1 if slice_hook is None else len(spans))
                copy_in_pieces(piece, source, lo, hi, copy_elems)
        transport.depart()
    if in_place is not None:
        transport.wait_departed(epoch, "finish writing its chunks into this rank's buffer" if pushed_any
                                else "finish reading this rank's buffer")


def _reduce_chunk(out, own, data, peers: List[int], lo: int, hi: int, combine, op: ReduceOp, size: int) -> None:
    """``out = own`` combined with ``data[peer][lo:hi]`` for each of ``peers`` in order (AVG: the
    sum, divided here while the chunk is in cache)."""
    combine(own, data[peers[0]][lo:hi], out=out)
    for peer in peers[1:]:
        combine(out, data[peer][lo:hi], out=out)
    if op is ReduceOp.AVG:
        out /= size


def interleaved_chunks(count: int, rank: int, size: int, chunk_elems: int) -> List[Span]:
    """Every ``size``-th chunk of ``count`` elements from chunk ``rank`` on, last first (see
    Order), the chunks at most ``chunk_elems`` and small enough that every rank gets one."""
    chunk_elems = max(1, min(chunk_elems, -(-count // size)))
    return chunk_spans((0, count), chunk_elems)[rank::size][::-1]


def _reduce_and_push(data, order: List[int], chunks: List[Span], combine, op: ReduceOp, size: int,
                     copy_elems: int, slice_hook, span: Span) -> None:
    """The push round: reduce ``chunks`` into this rank's buffer (``data[order[0]]``) and write each
    reduced chunk into every peer's buffer while it is still in this core's cache. With
    ``slice_hook``, ``chunks`` are this rank's slice ``span``, pushed after the hook."""
    mine = data[order[0]]
    peers = order[1:]
    for lo, hi in chunks:
        out = mine[lo:hi]
        _reduce_chunk(out, out, data, peers, lo, hi, combine, op, size)
        if slice_hook is None:
            for peer in peers:
                copy_in_pieces(data[peer], mine, lo, hi, copy_elems)
    if slice_hook is not None:
        lo, hi = span
        slice_hook(mine[lo:hi])
        for peer in peers:
            copy_in_pieces(data[peer], mine, lo, hi, copy_elems)


def copy_in_pieces(destination, source, lo: int, hi: int, copy_elems: int) -> None:
    """``destination[lo:hi] = source[lo:hi]`` in cache-sized pieces (a single large copy takes
    glibc's non-temporal path, which was 1.5x slower here)."""
    for start in range(lo, hi, copy_elems):
        stop = min(start + copy_elems, hi)
        destination[start:stop] = source[start:stop]


# The registry's flags are function attributes (see algorithms/__init__.py), which mypy cannot type.
allreduce_shm_twoshot.requires_shared_memory = True  # type: ignore[attr-defined]
allreduce_shm_twoshot.folds_average = True  # type: ignore[attr-defined]
