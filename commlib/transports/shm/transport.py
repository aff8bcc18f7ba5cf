"""The shared-memory transport: the ranks of one host read each other's memory directly.

Every rank owns one **segment** (a sparse file mapping, see :mod:`commlib.shm.segments`) that
every other rank of the host maps: read-only, except the heap, mapped read-write. A rank writes
its own segment and, only inside a collective that every rank runs on symmetric buffers, the
chunks of its peers' buffers that it computes (``shm_twoshot``'s push); it reads its peers' in
place, so data moves once, from the writer's pages into the reader's cache, instead of being
copied into a message and out again. A segment holds, page-aligned:

* the **control page**: per-rank counters on cache lines of their own (``ARRIVE`` with the
  descriptor of the data this rank offers, ``PROGRESS``, ``DONE``, the slots' signals with the
  data of the smallest rounds beside them);
* two **slots** (small messages, alternating between collectives) and two **staging halves**
  (larger plain buffers, chunked through them), both written only by their owner;
* the **heap** of symmetric buffers (:mod:`commlib.shm.symmetric_heap`): arrays allocated at the
  same offset on every rank, which collectives read without any staging copy.

Synchronisation is by counters, never by messages. Shared-memory collectives are numbered by an
**epoch** that is the same on every rank (they run in the group's one order). A rank publishes
its data, then the counter (``counter = epoch``); a reader waits for ``counter >= epoch`` and
then reads the data. Memory ordering: the writer issues a full fence between the data and the
counter (:func:`commlib.shm.segments.fence`): plain x86 stores become visible in program order,
but the non-temporal and fast-string stores of a large ``memcpy`` (numpy's copies) need not (so
on x86 a copy of under 2 KiB, plain stores, goes without: ``ORDERED_COPY_BYTES``).
The reader needs one between seeing the counter and reading the data only where loads may pass
older loads, i.e. not on x86 (``LOADS_IN_ORDER``); elsewhere the pair is an acquire/release.
Counters are aligned 8-byte words written with one store, so a reader never sees half of one.

Reuse without waiting: the slots and staging halves alternate by epoch parity, so an area is
written again two epochs after its last use. By then every peer has finished reading it: each
round waits until every peer has arrived at it, and a rank arrives at epoch ``k + 1`` only after
departing from ``k``. Only a symmetric buffer, which its owner may write as soon as the
collective returns, needs an explicit wait for the peers' departure.

Waiting (:mod:`.waiting`) spins briefly, yields, then sleeps, with the collective's deadline and
a check that the peer process still exists. The smallest rounds go through the slots
(:mod:`.slot_round`); the numbers every part agrees on are in :mod:`.layout`.

Everything else of the transport contract (``post``, the ``native_*`` collectives) goes to the
point-to-point transport it was built over (MPI over the same ranks), if any.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from commlib.errors import CollectiveMismatchError, CommError, InvalidUsageError
from commlib.platform.machine import cores_available, oversubscribed
from commlib.shm.segments import fence, populate
from commlib.transports.interface import Pending, Transfer, Transport
from commlib.transports.shm.layout import (ADDRESS, ARRIVE, CONTROL_BYTES, DONE, LOADS_IN_ORDER, OUTPUT, PROGRESS,
                                           PROGRESS_BITS, SegmentLayout, describe_kind)
from commlib.transports.shm.slot_round import build_slot_round
from commlib.transports.shm.waiting import (MIDWAY_SLEEP_AFTER_SECONDS, OVERSUBSCRIBED_SPIN_POLLS, SLEEP_AFTER_SECONDS,
                                            SPIN_POLLS, PeerWaiter)
from commlib.units import format_bytes

__all__ = ["SharedMemoryTransport"]

_CHUNKS_MASK = (1 << PROGRESS_BITS) - 1
_BYTE = np.dtype(np.uint8)


def _dead_reference():  # what a weak reference to a buffer that died returns
    return None


class SharedMemoryTransport(Transport):
    """Direct access to the segments of ``len(segments)`` ranks of one host; this is ``rank``."""

    xp = np
    direct_access = True

    def __init__(self, segments: Sequence, rank: int, layout: SegmentLayout, *, p2p: Optional[Transport] = None,
                 pids: Optional[Sequence[int]] = None, hostname: str = "", ranks: Optional[Sequence[int]] = None,
                 progress_board=None, heaps: Optional[Sequence] = None):
        super().__init__()
        self.rank, self.size = rank, len(segments)
        self.layout = layout
        self.p2p = p2p
        if p2p is not None:
            if (p2p.rank, p2p.size) != (self.rank, self.size):
                raise ValueError(f"shared-memory transport: rank {rank} of {self.size} over a point-to-point "
                                 f"transport of rank {p2p.rank} of {p2p.size}")
            self.context = p2p.context  # one collective, one description in every error message
        self.pids = list(pids) if pids is not None else [os.getpid()] * self.size
        self.hostname = hostname
        self.ranks = list(ranks) if ranks is not None else list(range(self.size))  # group rank of each
        self.progress_board = progress_board
        # Ranks outnumber cores (this host's, or the machine's when hosts share one: see
        # commlib/platform/machine.py): the peer we wait for may need our core, so yield at once.
        crowded = self.size > cores_available() or oversubscribed()
        self.spin_polls = OVERSUBSCRIBED_SPIN_POLLS if crowded else SPIN_POLLS
        self.midway_sleep_after = SLEEP_AFTER_SECONDS if crowded else MIDWAY_SLEEP_AFTER_SECONDS
        self.own_segment = segments[rank]
        self.segments = list(segments)
        self.controls = [memoryview(segment)[:CONTROL_BYTES].cast("q") for segment in segments]
        self.own_control = self.controls[rank]
        self.peer_controls = [(peer, control) for peer, control in enumerate(self.controls) if peer != rank]
        own = np.frombuffer(self.own_segment, np.uint8)
        self._own_bytes: Optional[np.ndarray] = own
        self._own_address = own.ctypes.data
        self.segment_arrays = [own if peer == rank else np.frombuffer(segment, np.uint8)
                       for peer, segment in enumerate(segments)]
        # ``heaps``: each peer's heap mapped read-write on its own (None for this rank), its segment
        # then mapping only what precedes the heap, read-only: symmetric buffers are reached
        # through the heap's mapping, the rest through the segment's (see _place).
        self.heaps = list(heaps) if heaps is not None else [None] * self.size
        self._heap_bytes = [None if heap is None else np.frombuffer(heap, np.uint8) for heap in self.heaps]
        # Whether this rank can write every peer's heap: the same on every rank of a group (its
        # mappings are made collectively, all or none).
        self.peers_writable = all(heap is not None or self.segment_arrays[peer].flags.writeable
                                  for peer, heap in enumerate(self._heap_bytes))
        start, slot = layout.slots_start, layout.slot_bytes
        staging_start, half = layout.staging_start, layout.staging_bytes
        # Areas this rank writes: 0, 1 the slots; 2, 3 the staging halves.
        self.areas = [(start, slot), (start + slot, slot), (staging_start, half), (staging_start + half, half)]
        self.area_arrays = [(offset, own[offset:offset + nbytes]) for offset, nbytes in self.areas]
        #: The last epoch begun (the slot round advances it too).
        self.epoch = 0
        # A small allreduce issued inline (slot_round with a sequence number) records only its
        # number and size here; self.context is filled from them if it ever needs to wait long
        # or fails (_current_context): ~0.2 us less per call.
        self.inline_seq, self.inline_nbytes, self.inline_timeout = 0, 0, float("inf")
        self._views: Dict[tuple, np.ndarray] = {}
        self._located: tuple = (_dead_reference, None)  # (weak reference to the last buffer located, its offset)
        # Set by the group when every rank can copy from every peer's private memory (see
        # commlib/shm/cross_memory.py): shm_direct's two-rank broadcast, scatter and gather then split
        # their one cross copy between the two ranks.
        self.cross_memory: Optional[Any] = None
        self.waits = PeerWaiter(self)
        self.slot_round, self._forget_slot_views = build_slot_round(self)

    # -- the epoch and the areas this rank writes -------------------------------------------------
    def begin(self) -> int:
        """Number the next shared-memory collective (every rank runs the same ones in the same order)."""
        self.epoch += 1
        return self.epoch

    def claim_staging(self, epoch: int):
        """``(offset, bytes)``: this rank's staging half for ``epoch`` (see "Reuse")."""
        return self.area_arrays[2 + (epoch & 1)]

    def locate(self, buf) -> Optional[int]:
        """The offset of ``buf`` in this rank's segment, or None when it lives elsewhere."""
        last = self._located
        if last[0]() is buf:  # asked twice in one call: "auto" asks, then the algorithm
            return last[1]
        start = buf.__array_interface__["data"][0] - self._own_address  # 1.1 us: the dict is built anew
        offset = start if 0 <= start and start + buf.nbytes <= self.layout.total_bytes else None
        try:
            # An array keeps its data address for life; the weak reference keeps nothing alive.
            self._located = (weakref.ref(buf), offset)
        except TypeError:
            pass
        return offset

    # -- arriving: publish where this rank's data is, wait for everyone's ---------------------------
    def arrive(self, epoch: int, offset: int, nbytes: int, kind: int, total_bytes: int) -> None:
        """Offer ``[offset, offset + nbytes)`` of this rank's segment for ``epoch``.

        ``kind`` (:func:`kind_code`) and ``total_bytes`` (of the whole collective, which may take
        several epochs) are compared with every peer's at :meth:`offers`. Descriptors alternate
        between two places: a fast peer may publish ``epoch + 1``'s before a slow one has read
        this one, never ``epoch + 2``'s (it cannot arrive there before everyone arrived at
        ``epoch + 1``).
        """
        control = self.own_control
        base = ARRIVE + 2 + 4 * (epoch & 1)
        control[base] = offset
        control[base + 1] = nbytes
        control[base + 2] = kind
        control[base + 3] = total_bytes
        fence()
        control[ARRIVE] = epoch

    def offered_arrays(self, offsets: Sequence[int], count: int, dtype) -> List[np.ndarray]:
        """``count`` elements of ``dtype`` at each rank's offset (from :meth:`offers`), in rank order."""
        view = self._view
        return [view(peer, offset, count, dtype) for peer, offset in enumerate(offsets)]

    def offers(self, epoch: int, nbytes: int, kind: int, total_bytes: int) -> List[int]:
        """Wait until every rank arrived at ``epoch`` (checking that all offer the same ``nbytes``,
        ``kind`` and ``total_bytes``); the offset each offered in its segment, in rank order."""
        controls = self.controls
        for peer, control in self.peer_controls:
            if control[ARRIVE] < epoch:
                self.waits.wait(peer, ARRIVE, epoch, "arrive")
        if not LOADS_IN_ORDER:
            fence()
        base = ARRIVE + 2 + 4 * (epoch & 1)
        offsets = []
        for peer in range(self.size):
            control = controls[peer]
            if (control[base + 1] != nbytes or control[base + 2] != kind
                    or control[base + 3] != total_bytes):
                self.mismatch(peer, control[base + 3], control[base + 2], total_bytes, kind)
            offsets.append(control[base])
        return offsets

    def publish_address(self, epoch: int, address: int) -> None:
        """The virtual address of this rank's buffer for ``epoch`` (before :meth:`arrive`, whose
        fence orders it before the arrival), for peers that copy by cross-memory attach."""
        self.own_control[ADDRESS + (epoch & 1)] = address

    def address_of(self, peer: int, epoch: int) -> int:
        """What ``peer`` published with :meth:`publish_address` for ``epoch`` (after its arrival)."""
        return self.controls[peer][ADDRESS + (epoch & 1)]

    def publish_output(self, epoch: int, offset: int) -> None:
        """Where this rank's output for ``epoch`` is in its segment, 0 where it is not (before
        :meth:`arrive`, as :meth:`publish_address`): peers may then write it."""
        self.own_control[OUTPUT + (epoch & 1)] = offset

    def output_of(self, peer: int, epoch: int) -> int:
        """What ``peer`` published with :meth:`publish_output` for ``epoch`` (after its arrival)."""
        return self.controls[peer][OUTPUT + (epoch & 1)]

    def peer_bytes(self, peer: int, offset: int, nbytes: int) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of ``peer``'s segment (CommError if outside it)."""
        return self._view(peer, offset, nbytes, _BYTE)

    def staging_offset(self, epoch: int) -> int:
        """Where every rank's staging half for ``epoch`` starts in its segment."""
        return self.areas[2 + (epoch & 1)][0]

    def may_push(self, epoch: int, offsets: Sequence[int]) -> bool:
        """Whether a round may write into the peers' buffers: every rank offered its data in place
        (a symmetric buffer: neither staged nor absent, ``offsets`` from :meth:`offers`) and this
        rank can write the peers' heaps. Every rank decides alike: the offers are the same
        everywhere, and so are the heaps' mappings (made collectively, all or none)."""
        staged = self.staging_offset(epoch)
        return self.peers_writable and all(offset and offset != staged for offset in offsets)

    def _view(self, peer: int, offset: int, count: int, dtype, writable: bool = False) -> np.ndarray:
        key = (peer, offset, count, dtype, writable)
        array = self._views.get(key)
        if array is None:
            if len(self._views) > 512:
                self._views.clear()
            nbytes = count * dtype.itemsize
            place = self._place(peer, offset, nbytes)
            if writable and (place is None or not place[0].flags.writeable):
                raise CommError(f"rank {self.ranks[self.rank]}: {self.context.describe()}: cannot write "
                                f"[{offset}, {offset + nbytes}) of rank {self.ranks[peer]}'s segment")
            if place is None:
                raise CommError(f"rank {self.ranks[self.rank]}: {self.context.describe()}: rank "
                                f"{self.ranks[peer]} offered [{offset}, {offset + nbytes}) outside its segment")
            array = place[0][place[1]:place[1] + nbytes].view(dtype)
            self._views[key] = array
        return array

    def _place(self, peer: int, offset: int, nbytes: int) -> Optional[Tuple[np.ndarray, int]]:
        """``(bytes, index)``: where ``[offset, offset + nbytes)`` of ``peer``'s segment is mapped
        here (its heap's own mapping or the segment's), or None outside of either."""
        heap = self._heap_bytes[peer]
        heap_start = self.layout.heap_start
        if heap is not None and offset >= heap_start:
            array, start = heap, offset - heap_start
        else:
            array, start = self.segment_arrays[peer], offset
        return (array, start) if 0 <= start and start + nbytes <= array.size else None

    def writable_arrays(self, offsets: Sequence[int], count: int, dtype) -> List[np.ndarray]:
        """Like :meth:`offered_arrays`, writable (with :attr:`peers_writable`, in the heap only)."""
        view = self._view
        return [view(peer, offset, count, dtype, True) for peer, offset in enumerate(offsets)]

    def populate_peer(self, peer: int, offset: int, nbytes: int) -> None:
        """Fault in this process's mapping of ``[offset, offset + nbytes)`` of ``peer``'s segment
        (``offset`` a page boundary) now, so the first collective does not pay a fault per page."""
        heap = self.heaps[peer]
        if heap is not None and offset >= self.layout.heap_start:
            populate(heap, offset - self.layout.heap_start, nbytes, write=True)
        else:
            populate(self.segments[peer], offset, nbytes, write=False)

    def mismatch(self, peer: int, their_bytes: int, their_kind: int, nbytes: int, kind: int) -> None:
        raise CollectiveMismatchError(
            f"rank {self.ranks[self.rank]} on {self.hostname}: {self.current_context().describe()}: rank "
            f"{self.ranks[peer]} contributes {format_bytes(their_bytes)} of {describe_kind(their_kind)}, "
            f"this rank {format_bytes(nbytes)} of {describe_kind(kind)}; every rank must pass the same "
            f"size, dtype and op")

    # -- progress of a slice, and departure ----------------------------------------------------------
    def publish_progress(self, epoch: int, chunks: int) -> None:
        fence()
        self.own_control[PROGRESS] = (epoch << PROGRESS_BITS) | chunks

    def progress_of(self, peer: int, epoch: int) -> int:
        """How many chunks of its slice ``peer`` has published for ``epoch`` so far (no waiting)."""
        value = self.controls[peer][PROGRESS]
        if value >> PROGRESS_BITS != epoch:
            return 0
        if not LOADS_IN_ORDER:
            fence()
        return value & _CHUNKS_MASK

    def wait_progress(self, peer: int, epoch: int, chunks: int) -> None:
        target = (epoch << PROGRESS_BITS) | chunks
        if self.controls[peer][PROGRESS] < target:
            self.waits.wait(peer, PROGRESS, target, "reduce the next chunk of its slice")
        if not LOADS_IN_ORDER:
            fence()

    def depart(self, wrote: bool = False) -> None:
        """This rank will not read any peer's memory for the current epoch (or earlier) any more;
        ``wrote``: nor write it, and what it wrote there is visible before the departure."""
        if wrote:
            fence()
        self.own_control[DONE] = self.epoch

    def wait_departed(self, epoch: int, what: str = "finish reading this rank's buffer") -> None:
        for peer, control in self.peer_controls:
            if control[DONE] < epoch:
                self.waits.wait(peer, DONE, epoch, what)
        if not LOADS_IN_ORDER:  # the peers may have written this rank's buffer before departing
            fence()

    # -- what waits and errors read --------------------------------------------------------------
    def current_context(self):
        """The collective context, filled in from the inline slot round's number when it ran one
        the context has not seen (the fast path records only its number and size)."""
        context = self.context
        if self.inline_seq > context.seq:  # the deadline counts from now: microseconds late
            context.begin("allreduce", self.inline_seq, "shm_oneshot", self.inline_nbytes, self.inline_timeout)
        return context

    def describe_peer(self, peer: int) -> str:
        """``rank R (pid P on HOST)``, for error messages."""
        return f"rank {self.ranks[peer]} (pid {self.pids[peer]} on {self.hostname})"

    # -- the rest of the transport contract -----------------------------------------------------------
    def post(self, sends: Sequence[Transfer] = (), recvs: Sequence[Transfer] = ()) -> Pending:
        return self._point_to_point("post").post(sends, recvs)

    def __getattr__(self, name: str):
        if name.startswith("native_"):  # the library's own collectives, over the same ranks
            return getattr(self._point_to_point(name), name)
        raise AttributeError(name)

    def _point_to_point(self, what: str) -> Transport:
        if self.p2p is None:
            raise InvalidUsageError(
                f"shared-memory transport of rank {self.ranks[self.rank]} on {self.hostname}: {what} "
                f"needs a point-to-point transport over the same ranks; this one was built without")
        return self.p2p

    def close(self) -> None:
        super().close()
        self._views.clear()
        self._forget_slot_views()
        self.segment_arrays = []
        self._heap_bytes = []
        self._own_bytes = None
        for control in self.controls:
            control.release()
        self.controls = []
        self.peer_controls = []
        self.own_control = None  # type: ignore[assignment]  # closed: never read again
        for segment in self.segments + [heap for heap in self.heaps if heap is not None]:
            try:
                segment.close()
            except (BufferError, ValueError):  # arrays over it still alive: unmapped with the last one
                pass
        self.segments = []
        self.heaps = []
