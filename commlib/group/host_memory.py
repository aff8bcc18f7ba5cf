"""A group's shared memory on its host: the segments, the symmetric heap, the transport over them.

Created with the group (collective over the group's ranks on each host). What it gives:

* ``transport``: a :class:`~commlib.transports.shm.SharedMemoryTransport` over the group's ranks
  on this host (it shares the group's collective context: deadline, sequence number). When the
  whole group is on this host (``single_host``), its point-to-point side is the group's MPI
  transport and the shared-memory algorithms (``shm_oneshot``, ``shm_twoshot``) run on it. A
  group spanning hosts keeps the segments (symmetric buffers are still host memory), but the
  shared-memory algorithms refuse it: they would leave out the other hosts' ranks.

Entry point for a hierarchical allreduce (its intra-host phases): on every rank, inside the
group's collective, ``allreduce_shm_twoshot(group.host_memory.transport, buf, op,
slice_hook=across_hosts)`` reduce-scatters ``buf`` among this host's ranks, calls
``across_hosts(slice)`` with this rank's reduced slice (allreduce it in place with the ranks of
the same host rank on the other hosts), then allgathers the slices within the host.
* ``alloc(group, shape, dtype)``: a symmetric buffer (collective; see :mod:`.symmetric_heap`).

Segment sizes (per rank; sparse, so memory is spent only on what is used): two slots of
``Config.shm_slot_bytes``, two staging halves of ``Config.shm_staging_bytes`` and a heap of
``Config.shm_heap_bytes``.
"""

from __future__ import annotations

import weakref
from typing import Optional

import numpy as np

from commlib.errors import CommError, InvalidUsageError
from commlib.group.validation import array_kind
from commlib.ops import DTYPE_IS_FLOAT, SUPPORTED_DTYPE_NAMES, ReduceOp
from commlib.shm.cross_memory import probe_cross_memory
from commlib.shm.segments import map_host_files, populate, release
from commlib.shm.symmetric_heap import SymmetricHeap
from commlib.transports.shm.layout import SegmentLayout
from commlib.transports.shm.transport import SharedMemoryTransport
from commlib.units import format_bytes

__all__ = ["HostMemory", "open_host_memory", "no_shared_memory_error"]

_DTYPE_NUMBERS = {dtype: number for number, dtype in enumerate(DTYPE_IS_FLOAT)}


def open_host_memory(rendezvous, config, *, p2p, progress_board) -> Optional["HostMemory"]:
    """Collective over ``rendezvous`` (the group's): this group's segments on every host, or None
    everywhere on failure."""
    rank, size = rendezvous.rank, rendezvous.size
    layout = SegmentLayout.create(config.shm_slot_bytes, config.shm_staging_bytes, config.shm_heap_bytes)
    host = rendezvous.host_local()
    try:
        host_ranks = host.allgather(rank)  # group rank of each host rank
        # Peers may write each other's heap (shm_twoshot and shm_direct's allgather push into the
        # peers' symmetric buffers), nothing else of a segment.
        files = map_host_files(host, layout.total_bytes, kind="shm", peers_writable_from=layout.heap_start)
    finally:
        host.close()
    everywhere = rendezvous.all_agree(files is not None)
    if not everywhere or files is None:  # files is None only where everywhere is False
        if files is not None:
            for mapping in files.mappings + (files.tails or []):
                if mapping is not None:
                    mapping.close()
        return None
    single_host = len(host_ranks) == size
    transport = SharedMemoryTransport(files.mappings, files.host_rank, layout,
                                      p2p=p2p if single_host else None, pids=files.pids,
                                      hostname=files.hostname, ranks=host_ranks,
                                      progress_board=progress_board, heaps=files.tails)
    # Across hosts too: a collective of the group that runs a phase on this host's ranks (the
    # intra-host steps of a hierarchical allreduce) has its deadline and description here.
    transport.context = p2p.context
    if single_host and size > 1 and config.shm_cross_memory:
        transport.cross_memory = probe_cross_memory(rendezvous, transport)  # collective: the same everywhere
    return HostMemory(transport, single_host, host_ranks)


def no_shared_memory_error(collective: str, algorithm: str, config, group) -> InvalidUsageError:
    """Why ``group``, which has no shared memory, cannot run a shared-memory algorithm (or, for
    ``collective="alloc"``, give a symmetric buffer)."""
    why = "COMMLIB_SHM=0" if not config.shm else "it could not be set up"
    if collective == "alloc":
        return InvalidUsageError(f"alloc: {group!r} has no shared memory ({why})")
    return InvalidUsageError(f"{collective}: algorithm {algorithm!r} reads the peers' memory directly, so only "
                             f"within one host: this group has no shared memory ({why})")


class HostMemory:
    def __init__(self, transport: SharedMemoryTransport, single_host: bool, host_ranks):
        self.transport = transport
        self.single_host = single_host
        self.host_ranks = list(host_ranks)
        layout = transport.layout
        self.heap = SymmetricHeap(layout.heap_start, layout.total_bytes)
        self._own = transport.own_segment
        self._closed = False

    # -- symmetric buffers ---------------------------------------------------------------------
    def alloc(self, group, shape, dtype):
        """A symmetric buffer of ``shape`` and ``dtype`` (collective over ``group``).

        Agreement runs as ordinary collectives of the group, in the caller's thread, so that a
        request the ranks do not agree on (or that cannot fit) raises on every rank without
        leaving the group unusable.
        """
        shape, dtype, nbytes = _check_request(shape, dtype)
        heap = self.heap
        if group.size > 1:
            mine = np.array([nbytes, _DTYPE_NUMBERS[dtype]], np.int64)
            requests = np.empty((group.size, 2), np.int64)
            group.allgather(requests, mine)
            if (requests != mine).any():
                names = list(DTYPE_IS_FLOAT)
                shown = "; ".join(f"rank {r}: {format_bytes(int(b))} of {names[int(d)]}"
                                  for r, (b, d) in enumerate(requests))
                raise InvalidUsageError(f"alloc: every rank of {group!r} must ask for the same bytes and "
                                        f"dtype (this rank: {shape} {dtype}); got {shown}")
        serials = heap.live_serials()  # the same on every rank: every allocation was collective
        if serials:
            flags = np.array(heap.released_flags(serials), np.int8)
            if group.size > 1:
                group.allreduce(flags, ReduceOp.MIN, algorithm="native")
            heap.reclaim(serials, flags.tolist())
        region = heap.place(nbytes)
        if region is None:
            raise InvalidUsageError(
                f"alloc: {format_bytes(nbytes)} do not fit in the symmetric heap of {group!r}: "
                f"{format_bytes(heap.free_bytes())} free (largest piece {format_bytes(heap.largest_free())}) "
                f"of COMMLIB_SHM_HEAP_BYTES={self.transport.layout.heap_bytes}; free buffers (drop "
                f"every reference to them and their views) or raise the limit")
        error = None
        try:
            populate(self._own, region.offset, nbytes, write=True)
        except OSError as exc:
            error = exc
        ok = np.array([0 if error else 1], np.int8)
        if group.size > 1:
            group.allreduce(ok, ReduceOp.MIN, algorithm="native")
        if not ok[0]:
            heap.undo(region)
            release(self._own, region.offset, region.nbytes)
            raise CommError(f"rank {group.rank}: alloc of {format_bytes(nbytes)}: "
                            + (f"this rank could not get the memory ({error}); " if error else "")
                            + "a rank of the group could not get the memory in /dev/shm (full?)")
        for peer in range(self.transport.size):
            if peer != self.transport.rank:
                self.transport.populate_peer(peer, region.offset, nbytes)
        root = np.frombuffer(self._own, dtype=dtype, count=nbytes // dtype.itemsize, offset=region.offset)
        weakref.finalize(root, self._release, region)
        return root.reshape(shape)

    def _release(self, region) -> None:
        self.heap.release(region.serial)
        if not self._closed:
            release(self._own, region.offset, region.nbytes)

    def transport_for(self, algorithm: str, buf, collective: str, group_size: int):
        """The shared-memory transport for ``collective``'s algorithm ``algorithm`` on ``buf``, or
        ``InvalidUsageError`` saying why this group cannot run it."""
        if buf.__class__ is not np.ndarray and array_kind(buf) != "numpy":
            why = "it works on host memory; this buffer is on a GPU"
        elif not self.single_host:
            why = (f"the group spans several hosts (this host has ranks {self.host_ranks} of "
                   f"{group_size}); it would leave out the other hosts' ranks: use a hierarchical "
                   f"algorithm or 'auto'")
        else:  # the whole group is here (one rank: nothing to reduce, a valid call)
            return self.transport
        raise InvalidUsageError(f"{collective}: algorithm {algorithm!r} reads the peers' memory directly, "
                                f"so only within one host: {why}")

    def owns(self, array) -> bool:
        """Whether ``array`` lives in this rank's segment (a symmetric buffer or a view of one)."""
        return isinstance(array, np.ndarray) and self.transport.locate(array) is not None

    def close(self) -> None:
        self._closed = True
        self.transport.close()


def _check_request(shape, dtype):
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (int(shape),)
    try:
        shape = tuple(int(extent) for extent in shape)
    except (TypeError, ValueError):
        raise InvalidUsageError(f"alloc: shape must be an int or a tuple of ints, got {shape!r}") from None
    if any(extent < 0 for extent in shape):
        raise InvalidUsageError(f"alloc: shape {shape} has a negative extent")
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise InvalidUsageError(f"alloc: {dtype!r} is not a dtype") from None
    if dtype not in DTYPE_IS_FLOAT:
        raise InvalidUsageError(f"alloc: unsupported dtype {dtype}; expected one of "
                                f"{', '.join(SUPPORTED_DTYPE_NAMES)} (bfloat16 through ml_dtypes)")
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return shape, dtype, nbytes
