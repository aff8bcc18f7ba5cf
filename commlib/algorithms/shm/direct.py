"""``shm_direct``: broadcast, allgather, gather, scatter and alltoall by copying from the peers'
memory in place.

Needs a transport with direct access to its peers' memory (the ranks of one host, see
:mod:`commlib.transports.shm`). Each of these collectives only moves bytes: every rank has at most
one **source** (broadcast and scatter: the root's buffer; allgather, gather and alltoall: each
rank's ``inp``) and copies the byte ranges it needs from the peers' sources into its output.

Why not messages: within a host the MPI library moves a large message with one kernel copy from
the sender's pages (CMA), which is several times slower than a user-space ``memcpy`` from a
shared mapping at a few MiB, and as fast only where both run at the memory's speed (tens of MiB).
A rank cannot read a peer's
private buffer, so a plain source is first copied into its owner's staging half (shared), chunk by
chunk, while the readers copy the chunks already published out of it: the two copies run at once
on two cores. A **symmetric** source (``ProcessGroup.alloc``) is read where it is: one copy.

One round (the same part of each block of the source, at most a staging half over all of them;
each round is a shared-memory collective of its own, with its own epoch, and every rank takes part
in every round):

1. *Arrive*: publish where the round's source is (nothing to offer: the same size, never read);
   wait until every rank has, which checks that all agree on the collective's size.
2. *Stage*: a plain source's bytes that some peer reads are copied into the staging half in
   chunks of ``min(segment_bytes, CHUNK_BYTES)``, PROGRESS published after each. A symmetric
   source is complete from the start: its readers do not wait for PROGRESS (they tell the two
   apart by the offset offered: the staging half's, or anywhere else).
3. *Own part*: what this rank takes from its own source (allgather's own block...), locally.
4. *Read*: for each peer in rotated order, each needed range chunk by chunk, as the peer's
   PROGRESS covers it.
5. *Depart*: publish DONE. A symmetric source waits, before returning, until every peer has
   departed (the caller may write it next); staging defers that wait to the half's next use.

**Push** (an allgather whose every source and output is symmetric, see :func:`move_rounds`):
after the first arrival every rank instead writes its own block into every rank's output, each
piece read once and written ``P`` times while in cache, all in that one epoch; then *depart* and
wait for every peer's departure (then this rank's output is complete).

Invariants: a rank writes only its own output and its own staging half, or in the push only its
own block's place in the others' outputs; a chunk is read only after its owner published it;
every rank runs the same rounds (their count depends on the source size, which every rank
knows, and the push is chosen alike everywhere), so the epochs stay aligned with the other
shared-memory collectives.

Cost per rank for a message of ``n`` bytes to read: one copy of ``n`` from shared memory, plus,
for a plain source, its owner's staging copy of what the peers read, overlapped with their reads.
Where that pays: at P=2 a symmetric source up to a few MiB, with ties above, where the kernel's
copy runs at the memory's speed too; a plain source adds the staging copy and mostly loses at
P=2; at 4 and 8 ranks, reading the sources once beats the library's schedules, which is what
``auto`` takes (data: docs/benchmarks/shm-movers-p2, -p4, -symmetric-p2).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np

from commlib.transports.shm.layout import PROGRESS_BITS, move_kind_code
# reduce_order: this rank first, then rank + 1, rank + 2, ...: the ranks read different peers at any
# moment, in the reads below as in the two-shot's reductions.
from commlib.algorithms.shm.twoshot import COPY_BYTES, copy_in_pieces, reduce_order

__all__ = ["broadcast_shm_direct", "allgather_shm_direct", "gather_shm_direct", "scatter_shm_direct",
           "alltoall_shm_direct", "move_rounds", "Read", "CHUNK_BYTES"]

# The unit a staged source is published in: small enough that a reader starts soon after its owner
# (4 MiB at P=2: 8 chunks), large enough that the per-chunk Python stays a few percent.
CHUNK_BYTES = 512 << 10

# Two ranks that may copy from each other's private memory (cross-memory attach, see
# commlib/shm/cross_memory.py) split a rooted mover's one cross copy from this size (the collective's
# bytes) on: the rank holding the bytes writes part of the other's buffer while the other reads
# the rest (the staged path's two copies lost to the library's one from 4 MiB).
COOPERATIVE_BYTES = 1 << 20
# The sender's share of the copy, by collective: the root of a scatter also copies its own block,
# and so does the root of a gather, there the receiver, so their best splits lean that way. Each
# is the share that was fastest in a probe of 0.1-0.9 at P=2, 4-64 MiB (the split rows of
# docs/benchmarks/shm-movers-p2).
PUSH_FRACTION = {"broadcast": 0.5, "scatter": 0.1, "gather": 0.75}

# (peer, source_lo, source_hi, destination_lo): copy bytes [source_lo, source_hi) of ``peer``'s
# source to ``destination[destination_lo:]`` (``peer`` may be this rank: a local copy).
Read = Tuple[int, int, int, int]
_Range = Tuple[int, int]
_BYTE = np.dtype(np.uint8)


def _bytes(array) -> Optional[np.ndarray]:
    return None if array is None else array.view(np.uint8)


def _blocks(size: int, block: int, skip: int) -> List[_Range]:
    return [(j * block, (j + 1) * block) for j in range(size) if j != skip]


def broadcast_shm_direct(transport, buf, root: int, *, segment_bytes: int) -> None:
    n = buf.nbytes
    if transport.size == 1 or n == 0:
        return
    if _splits(transport, n):
        _split_pair(transport, "broadcast", root, _bytes(buf), n, segment_bytes)
        return
    if transport.rank == root:
        move_rounds(transport, "broadcast", None, _bytes(buf), 1, n, [], [(0, n)], segment_bytes)
    else:
        move_rounds(transport, "broadcast", _bytes(buf), None, 1, n, [(root, 0, n, 0)], [], segment_bytes)


def allgather_shm_direct(transport, out, inp, *, segment_bytes: int) -> None:
    size, rank = transport.size, transport.rank
    n = inp.nbytes
    order = reduce_order(rank, size)
    reads = [(peer, 0, n, peer * n) for peer in order]
    # Every buffer symmetric: each rank writes its block into every rank's output instead, each
    # chunk read once for all of them, where the reads read every block once per reader (faster
    # from 4 MiB: docs/benchmarks/shm-movers-symmetric-p2).
    pushes = [(peer, 0, n, rank * n) for peer in order]
    move_rounds(transport, "allgather", _bytes(out), _bytes(inp), 1, n, reads, [(0, n)], segment_bytes,
                pushes=pushes)


def gather_shm_direct(transport, out, inp, root: int, *, segment_bytes: int) -> None:
    size, rank = transport.size, transport.rank
    n = inp.nbytes
    if n and _splits(transport, size * n):
        other = 1 - root
        if rank == root:
            out_bytes = out.view(np.uint8)
            _split_pair(transport, "gather", other, out_bytes[other * n:(other + 1) * n], size * n, segment_bytes,
                        local=(out_bytes[root * n:(root + 1) * n], _bytes(inp)))
        else:
            _split_pair(transport, "gather", rank, _bytes(inp), size * n, segment_bytes)
        return
    if rank == root:
        reads = [(peer, 0, n, peer * n) for peer in reduce_order(rank, size)]
        move_rounds(transport, "gather", _bytes(out), _bytes(inp), 1, n, reads, [], segment_bytes)
    else:
        move_rounds(transport, "gather", None, _bytes(inp), 1, n, [], [(0, n)], segment_bytes)


def scatter_shm_direct(transport, out, inp, root: int, *, segment_bytes: int) -> None:
    size, rank = transport.size, transport.rank
    n = out.nbytes
    if n and _splits(transport, size * n):
        if rank == root:
            inp_bytes, other = inp.view(np.uint8), 1 - root
            _split_pair(transport, "scatter", root, inp_bytes[other * n:(other + 1) * n], size * n, segment_bytes,
                        local=(_bytes(out), inp_bytes[root * n:(root + 1) * n]))
        else:
            _split_pair(transport, "scatter", root, _bytes(out), size * n, segment_bytes)
        return
    mine = [(root, rank * n, (rank + 1) * n, 0)]
    if rank == root:
        move_rounds(transport, "scatter", _bytes(out), _bytes(inp), size, n, mine, _blocks(size, n, rank),
                    segment_bytes)
    else:
        move_rounds(transport, "scatter", _bytes(out), None, size, n, mine, [], segment_bytes)


def _splits(transport, total_bytes: int) -> bool:
    """Whether a rooted mover of ``total_bytes`` goes by :func:`_split_pair` (the same on both ranks)."""
    return transport.size == 2 and total_bytes >= COOPERATIVE_BYTES and transport.cross_memory is not None


def _split_pair(transport, collective: str, sender: int, piece, total_bytes: int, segment_bytes: int,
                local=None) -> None:
    """Two ranks, one epoch: ``piece`` (bytes) of rank ``sender`` lands in the other rank's
    ``piece``. A symmetric source is read where it is by the receiver (as in the rounds). Any
    other: the sender writes the first ``PUSH_FRACTION[collective]`` of the receiver's piece and
    the receiver reads the rest from the sender's, by cross-memory attach, at once (on shared
    pages the kernel's copy is slower: a symmetric source split this way took 1.2-1.4x the
    library's time for a 16-64 MiB broadcast, read in place 0.84-0.89x). ``local``: the root's own
    block, ``(destination, source)``, copied after its part. Each waits for the other's departure
    before returning: the receiver reads the sender's memory, the sender may write the receiver's."""
    nbytes = piece.nbytes
    copy_bytes = max(1, min(segment_bytes, COPY_BYTES))
    kind = move_kind_code(collective)
    rank = transport.rank
    epoch = transport.begin()
    in_place = transport.locate(piece) if rank == sender else None
    transport.publish_address(epoch, piece.ctypes.data)
    transport.arrive(epoch, in_place or 0, nbytes, kind, total_bytes)  # 0: the control page, never a buffer
    offered = transport.offers(epoch, nbytes, kind, total_bytes)[sender]  # both here, the same sizes
    peer = 1 - rank
    if offered:
        if rank != sender:
            _copy(piece, 0, transport.peer_bytes(sender, offered, nbytes), 0, nbytes, copy_bytes)
    else:
        address = transport.address_of(peer, epoch)
        split = int(nbytes * PUSH_FRACTION[collective])
        if rank == sender:
            transport.cross_memory.write(peer, piece[:split], address)
        else:
            transport.cross_memory.read(peer, address + split, piece[split:])
    if local is not None:
        destination, source = local
        _copy(destination, 0, source, 0, source.nbytes, copy_bytes)
    transport.depart()
    transport.wait_departed(epoch, "finish its part of the copy")


def alltoall_shm_direct(transport, out, inp, *, segment_bytes: int) -> None:
    size, rank = transport.size, transport.rank
    block = inp.nbytes // size
    reads = [(peer, rank * block, (rank + 1) * block, peer * block) for peer in reduce_order(rank, size)]
    move_rounds(transport, "alltoall", _bytes(out), _bytes(inp), size, block, reads, _blocks(size, block, rank),
                segment_bytes)


def move_rounds(transport, collective: str, destination, source, blocks: int, block_bytes: int,
                reads: Sequence[Read], read_by_peers: Sequence[_Range], segment_bytes: int,
                pushes: Sequence[Read] = ()) -> None:
    """Carry out ``reads`` (into ``destination``, bytes) from the ranks' sources, in rounds (see
    the module docstring).

    Every rank's source is ``blocks`` blocks of ``block_bytes`` (the same on every rank, also
    where it has no source). Round ``k`` covers the same part of every block (at most a staging
    half over all blocks), so that in every round every rank has its share to read: a round over
    the first half of an alltoall's source would leave the ranks reading the second half idle.
    ``source``: this rank's source (bytes) or None; ``read_by_peers``: the byte ranges of it that
    some peer reads (what a plain source stages).

    ``pushes`` (given on every rank or on none): the same moves seen from the sources, ``(peer,
    source_lo, source_hi, destination_lo)``: this rank's source bytes into ``peer``'s
    destination. Where every rank's source and destination are symmetric and the peers' heaps
    writable here (every rank decides alike, from the first round's offers), the first round
    carries them out for the whole source instead, and the other rounds do not run.
    """
    rank, size = transport.rank, transport.size
    source_bytes = blocks * block_bytes
    copy_bytes = max(1, min(segment_bytes, COPY_BYTES))
    own = [read for read in reads if read[0] == rank]
    remote = [read for read in reads if read[0] != rank]
    if size == 1 or source_bytes == 0:
        for _, lo, hi, to in own:
            _copy(destination, to, source, lo, hi - lo, copy_bytes)
        return
    kind = move_kind_code(collective)
    # A round's chunk count must fit the PROGRESS word (a tiny segment_bytes could overflow it).
    chunk = max(1, min(segment_bytes, CHUNK_BYTES), -(-transport.layout.staging_bytes // ((1 << PROGRESS_BITS) - 1)))
    piece = max(1, transport.layout.staging_bytes // blocks)  # of each block, per round
    in_place = transport.locate(source) if source is not None and read_by_peers else None
    epoch = 0
    for start in range(0, block_bytes, piece):
        stop = min(start + piece, block_bytes)
        # The round's part of each block: (first byte, end) in the source, and its place in staging.
        windows = [(j * block_bytes + start, j * block_bytes + stop, j * piece) for j in range(blocks)]
        epoch = transport.begin()
        staging = None
        offset = 0  # no source: never read
        if in_place is not None:
            offset = in_place  # the whole source, where it is
        elif source is not None and read_by_peers:
            offset, staging = transport.claim_staging(epoch)
        if pushes and start == 0:
            transport.publish_output(epoch, transport.locate(destination) or 0)
        transport.arrive(epoch, offset, stop - start, kind, source_bytes)
        offers = transport.offers(epoch, stop - start, kind, source_bytes)
        if pushes and start == 0 and _everything_symmetric(transport, epoch, offers):
            _push(transport, epoch, source, destination.nbytes, pushes, copy_bytes)
            transport.depart(wrote=True)
            transport.wait_departed(epoch, "finish writing its block into this rank's output")
            return
        if staging is not None:
            _stage(transport, epoch, staging, source, windows, read_by_peers, chunk, copy_bytes)
        _copy_own(destination, source, own, windows, copy_bytes)
        _read_peers(transport, epoch, destination, remote, offers, windows, blocks * piece, source_bytes, chunk,
                    copy_bytes)
        transport.depart()
    if in_place is not None:
        transport.wait_departed(epoch)


def _copy_own(destination, source, own: Sequence[Read], windows, copy_bytes: int) -> None:
    """This round's part of the reads from this rank's own source."""
    for _, lo, hi, to in own:
        for window_lo, window_hi, _ in windows:
            a, b = max(lo, window_lo), min(hi, window_hi)
            if a < b:
                _copy(destination, to + a - lo, source, a, b - a, copy_bytes)


def _read_peers(transport, epoch: int, destination, remote: Sequence[Read], offers: Sequence[int], windows,
                staged_bytes: int, source_bytes: int, chunk: int, copy_bytes: int) -> None:
    """This round's part of the reads from the peers' sources. A peer's staging half holds the
    round's parts packed (and is published chunk by chunk); anywhere else the offer is its whole
    source, in place and complete."""
    staged_at = transport.staging_offset(epoch)
    for peer, lo, hi, to in remote:
        staged = offers[peer] == staged_at
        offered = transport.peer_bytes(peer, offers[peer], staged_bytes if staged else source_bytes)
        for window_lo, window_hi, place in windows:
            a, b = max(lo, window_lo), min(hi, window_hi)
            if a >= b:
                continue
            if not staged:
                _copy(destination, to + a - lo, offered, a, b - a, copy_bytes)
                continue
            at, end, into = place + a - window_lo, place + b - window_lo, to + a - lo
            while at < end:
                index = at // chunk
                upto = min((index + 1) * chunk, end)
                transport.wait_progress(peer, epoch, index + 1)
                _copy(destination, into, offered, at, upto - at, copy_bytes)
                into += upto - at
                at = upto


def _everything_symmetric(transport, epoch: int, offers: Sequence[int]) -> bool:
    """Whether every rank offered its source in place and published its destination's place."""
    return transport.may_push(epoch, offers) and all(transport.output_of(peer, epoch) for peer in range(transport.size))


def _push(transport, epoch: int, source, destination_bytes: int, pushes: Sequence[Read], copy_bytes: int) -> None:
    """Carry out ``pushes`` from this rank's source into the ranks' destinations, chunk by chunk;
    the moves of one source range (an allgather's) take each chunk from cache after the first."""
    outputs = transport.writable_arrays([transport.output_of(peer, epoch) for peer in range(transport.size)],
                                        destination_bytes, _BYTE)
    by_range: dict = {}
    for peer, lo, hi, to in pushes:
        by_range.setdefault((lo, hi), []).append((outputs[peer], to))
    for (lo, hi), targets in by_range.items():
        for at in range(lo, hi, copy_bytes):
            upto = min(at + copy_bytes, hi)
            chunk = source[at:upto]
            for output, to in targets:
                output[to + at - lo:to + upto - lo] = chunk


def _stage(transport, epoch: int, staging, source, windows, read_by_peers: Sequence[_Range], chunk: int,
           copy_bytes: int) -> None:
    """Copy the round's bytes that peers read into ``staging`` (each window at its place),
    publishing PROGRESS as chunks of the staging half become complete."""
    parts = sorted((place + a - window_lo, place + b - window_lo, a)
                   for window_lo, window_hi, place in windows for wanted_lo, wanted_hi in read_by_peers
                   for a, b in [(max(window_lo, wanted_lo), min(window_hi, wanted_hi))] if a < b)
    published = 0
    for at, end, source_at in parts:
        while at < end:
            upto = min((at // chunk + 1) * chunk, end)
            _copy(staging, at, source, source_at, upto - at, copy_bytes)
            source_at += upto - at
            at = upto
            # Parts are sorted and disjoint: every chunk that ends by ``at`` is complete.
            if at // chunk > published:
                published = at // chunk
                transport.publish_progress(epoch, published)
    window_lo, window_hi, place = windows[-1]
    chunks = -(-(place + window_hi - window_lo) // chunk)
    if published != chunks:  # the last partial chunk, and any nobody reads
        transport.publish_progress(epoch, chunks)


def _copy(destination, to: int, source, frm: int, nbytes: int, copy_bytes: int) -> None:
    """``destination[to:to + nbytes] = source[frm:frm + nbytes]`` in cache-sized pieces (the
    two-shot's ``copy_in_pieces``, between different offsets)."""
    copy_in_pieces(destination[to:to + nbytes], source[frm:frm + nbytes], 0, nbytes, copy_bytes)


# The registry's flags are function attributes (see algorithms/__init__.py), which mypy cannot type.
for _fn in (broadcast_shm_direct, allgather_shm_direct, gather_shm_direct, scatter_shm_direct,
            alltoall_shm_direct):
    setattr(_fn, "requires_shared_memory", True)  # noqa: B010 - a flag mypy cannot type on a function
