"""The shared-memory transport: the ranks of one host read each other's memory directly.

Every rank owns one **segment** (a sparse file mapping, see :mod:`commlib.shared_memory`) that
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
* the **heap** of symmetric buffers (:mod:`commlib.symmetric_heap`): arrays allocated at the
  same offset on every rank, which collectives read without any staging copy.

Synchronisation is by counters, never by messages. Shared-memory collectives are numbered by an
**epoch** that is the same on every rank (they run in the group's one order). A rank publishes
its data, then the counter (``counter = epoch``); a reader waits for ``counter >= epoch`` and
then reads the data. Memory ordering: the writer issues a full fence between the data and the
counter (:func:`commlib.shared_memory.fence`): plain x86 stores become visible in program order,
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

Waiting spins briefly, then yields the core (``sched_yield``: with more ranks than cores the
peer needs this very core to make the progress we wait for), then sleeps with backoff. It has
the group's deadline (``CommTimeoutError`` naming the peer, its counter and the progress board's
laggards) and, while sleeping, checks that the peer process still exists (``CommError`` naming
it, without waiting for the deadline).

Everything else of the transport contract (``post``, the ``native_*`` collectives) goes to the
point-to-point transport it was built over (MPI over the same ranks), if any.
"""

from __future__ import annotations

import os
import platform
import time
import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from ..errors import CollectiveMismatchError, CommError, CommTimeoutError, InvalidUsageError
from ..machine import cores_available, oversubscribed
from ..ops import DTYPE_IS_FLOAT, ReduceOp, ufunc_name
from ..shared_memory import PAGE_BYTES, fence, fence_lock, populate
from ..timer_slack import FineSleeper
from .interface import Pending, Transfer, Transport, format_bytes

__all__ = ["SharedMemoryTransport", "SegmentLayout", "kind_code", "move_kind_code"]

# Control words (int64 indices into a segment's control page); one 64-byte line each.
ARRIVE = 0          # epoch; descriptor at ARRIVE + 2 + 4 * (epoch & 1), see arrive()
PROGRESS = 16       # (epoch << PROGRESS_BITS) | chunks of this rank's slice reduced so far
ADDRESS = 10        # + epoch parity: the virtual address of this rank's buffer (cross-memory rounds)
OUTPUT = 12         # + epoch parity: where this rank's output is in its segment (0: not there)
DONE = 24           # epoch whose reads of peers' buffers in place this rank has finished (depart)
SLOT_SIGNAL = 32    # per slot parity p, a line each: [SLOT_SIGNAL + 8p] epoch, [+ 1] signature, [+ 2 ..] data
# A round of at most this many bytes carries its data on its signal's cache line (after the epoch
# and the signature), not in the slot: the peer that sees the signal has the data in the same
# line, one cache miss fewer (NCCL's LL protocol does the same with flags beside the data).
LINE_DATA_BYTES = 48
PROGRESS_BITS = 24
CONTROL_BYTES = PAGE_BYTES

# x86 (Intel and AMD) never reorders a load with an older load, so a reader that saw a counter
# reads the data stored before it without a fence; other architectures need the reader's fence.
LOADS_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
# A copy of fewer bytes is plain (vector) stores, which x86 makes visible in program order, so the
# counter written after it needs no fence: glibc's memcpy (numpy's copies) switches to fast-string
# stores from 2 KiB (its smallest `rep movsb` threshold) and to non-temporal ones far above.
# Elsewhere every copy is followed by a fence. (Measured: the fence is 0.1 us of an 8-byte round.)
ORDERED_COPY_BYTES = 2048 if LOADS_IN_ORDER else 0

SPIN_POLLS = 256            # ~10 us of polling before the first yield
# More ranks on the host than cores: a peer we wait for may need this very core, so yield at once
# (measured at P=4 on 2 cores, 8 B: 16 us with 1 poll, 22 us with 16, 19 us with 64; MPI 21 us;
# at P=3 1 and 32 polls were alike).
OVERSUBSCRIBED_SPIN_POLLS = 1
SLEEP_AFTER_SECONDS = 1e-4  # yielding this long turns into sleeping
# Waiting for a peer that is already inside the collective (its PROGRESS or DONE), not for its
# arrival: it runs the same schedule and is due within about the ranks' imbalance (0.1-0.2 ms at
# 16 MiB, P=2). A wait that fell asleep there woke late, and the woken rank's return made the
# call's time: at 16 MiB the allreduce took 1.01-1.03 ms against 0.84-0.88 ms without sleeping
# (same runs). So such a wait yields for longer before it sleeps, unless ranks share cores
# (then a sleeping waiter hands its core to the rank it waits for).
MIDWAY_SLEEP_AFTER_SECONDS = 2e-3
MAX_SLEEP_SECONDS = 2e-4
LIVENESS_EVERY_SECONDS = 0.1

_fence_acquire, _fence_release = fence_lock.acquire, fence_lock.release  # fence(), without a call
_CHUNKS_MASK = (1 << PROGRESS_BITS) - 1
_BYTE = np.dtype(np.uint8)


def _dead_reference():  # what a weak reference to a buffer that died returns
    return None


# A round of an epoch raises ARRIVE (shm_twoshot, shm_direct) or its slot's signal (shm_oneshot),
# never both: a peer waited for on one that raised the other for the same epoch diverged.
_ROUND_WORDS = frozenset((ARRIVE, SLOT_SIGNAL, SLOT_SIGNAL + 8))
_TOTAL_MASK = (1 << 44) - 1  # a slot signature: kind_code << 44 | the collective's total bytes
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPE_IS_FLOAT, start=1)}
_OP_CODES = {op: code for code, op in enumerate(ReduceOp, start=1)}


def kind_code(dtype, op: ReduceOp) -> int:
    """One word naming a contribution's dtype and op, compared across ranks at arrival."""
    return (_DTYPE_CODES[dtype] << 8) | _OP_CODES[op]


# The data-movement collectives (shm_direct) compare which collective, not a dtype and op: they
# move bytes. Above every kind_code (dtype codes < 256).
_MOVE_KINDS = ("broadcast", "allgather", "gather", "scatter", "alltoall")
_MOVE_KIND_BASE = 1 << 16


def move_kind_code(collective: str) -> int:
    """The kind word of a data-movement collective, compared across ranks at arrival."""
    return _MOVE_KIND_BASE + _MOVE_KINDS.index(collective)


def _describe_kind(code: int) -> str:
    if code >= _MOVE_KIND_BASE:
        index = code - _MOVE_KIND_BASE
        return f"{_MOVE_KINDS[index] if index < len(_MOVE_KINDS) else '?'} bytes"
    dtypes = {value: key for key, value in _DTYPE_CODES.items()}
    ops = {value: key for key, value in _OP_CODES.items()}
    dtype, op = dtypes.get(code >> 8), ops.get(code & 0xFF)
    return f"{dtype if dtype is not None else '?'} {op.name if op is not None else '?'}"


def _out_by_keyword(ufunc):
    """``ufunc(a, b, out)`` for the ufuncs that deprecate a positional ``out`` (numpy 2.4:
    ``maximum``, ``minimum``); the others take it positionally, 120 ns faster than by keyword."""
    def combine(a, b, out):
        return ufunc(a, b, out=out)

    return combine


class SegmentLayout(NamedTuple):
    """Byte offsets in every rank's segment (page-aligned)."""

    slot_bytes: int      # each of the two small-message slots
    staging_bytes: int   # each of the two staging halves
    heap_bytes: int

    @property
    def slots_start(self) -> int:
        return CONTROL_BYTES

    @property
    def staging_start(self) -> int:
        return CONTROL_BYTES + 2 * self.slot_bytes

    @property
    def heap_start(self) -> int:
        return self.staging_start + 2 * self.staging_bytes

    @property
    def total_bytes(self) -> int:
        return self.heap_start + self.heap_bytes

    @classmethod
    def create(cls, slot_bytes: int, staging_bytes: int, heap_bytes: int) -> "SegmentLayout":
        def pages(nbytes):
            return max(PAGE_BYTES, -(-nbytes // PAGE_BYTES) * PAGE_BYTES)
        return cls(pages(slot_bytes), pages(staging_bytes), -(-heap_bytes // PAGE_BYTES) * PAGE_BYTES)


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
        # commlib/machine.py): the peer we wait for may need our core, so yield at once.
        crowded = self.size > cores_available() or oversubscribed()
        self.spin_polls = OVERSUBSCRIBED_SPIN_POLLS if crowded else SPIN_POLLS
        self._midway_sleep_after = SLEEP_AFTER_SECONDS if crowded else MIDWAY_SLEEP_AFTER_SECONDS
        self.own_segment = segments[rank]
        self.segments = list(segments)
        self._controls = [memoryview(segment)[:CONTROL_BYTES].cast("q") for segment in segments]
        self._own_control = self._controls[rank]
        self._peer_controls = [(peer, control) for peer, control in enumerate(self._controls) if peer != rank]
        own = np.frombuffer(self.own_segment, np.uint8)
        self._own_bytes: Optional[np.ndarray] = own
        self._own_address = own.ctypes.data
        self._bytes = [own if peer == rank else np.frombuffer(segment, np.uint8)
                       for peer, segment in enumerate(segments)]
        # ``heaps``: each peer's heap mapped read-write on its own (None for this rank), its segment
        # then mapping only what precedes the heap, read-only: symmetric buffers are reached
        # through the heap's mapping, the rest through the segment's (see _place).
        self.heaps = list(heaps) if heaps is not None else [None] * self.size
        self._heap_bytes = [None if heap is None else np.frombuffer(heap, np.uint8) for heap in self.heaps]
        # Whether this rank can write every peer's heap: the same on every rank of a group (its
        # mappings are made collectively, all or none).
        self.peers_writable = all(heap is not None or self._bytes[peer].flags.writeable
                                  for peer, heap in enumerate(self._heap_bytes))
        start, slot = layout.slots_start, layout.slot_bytes
        staging_start, half = layout.staging_start, layout.staging_bytes
        # Areas this rank writes: 0, 1 the slots; 2, 3 the staging halves.
        self._areas = [(start, slot), (start + slot, slot), (staging_start, half), (staging_start + half, half)]
        self._area_arrays = [(offset, own[offset:offset + nbytes]) for offset, nbytes in self._areas]
        self._epoch = 0
        # A small allreduce issued inline (slot_round with a sequence number) records only its
        # number and size here; self.context is filled from them if it ever needs to wait long
        # or fails (_current_context): ~0.2 us less per call.
        self.inline_seq, self.inline_nbytes, self.inline_timeout = 0, 0, float("inf")
        self._views: Dict[tuple, np.ndarray] = {}
        self._located: tuple = (_dead_reference, None)  # (weak reference to the last buffer located, its offset)
        # Set by the group when every rank can copy from every peer's private memory (see
        # commlib/cross_memory.py): shm_direct's two-rank broadcast, scatter and gather then split
        # their one cross copy between the two ranks.
        self.cross_memory: Optional[Any] = None
        self.slot_round, self._forget_slot_views = self._build_slot_round()

    # -- the epoch and the areas this rank writes -------------------------------------------------
    @property
    def epoch(self) -> int:
        """The last epoch begun."""
        return self._epoch

    def begin(self) -> int:
        """Number the next shared-memory collective (every rank runs the same ones in the same order)."""
        self._epoch += 1
        return self._epoch

    # -- small rounds through the slots (shm_oneshot) -------------------------------------------------
    def _build_slot_round(self):
        """``(slot_round, forget)``: one round of ``shm_oneshot``, and what drops its views at close.

        ``slot_round(seq, limit, piece, op, total_bytes=None) -> bool``:

        Copy ``piece`` into this rank's slot, signal, wait until every rank signalled the same
        round, then combine all ``P`` slots in rank order into ``piece`` (AVG: and divide).
        ``total_bytes`` is the whole collective's size when ``piece`` is one of its chunks
        (None: the piece is the collective). False, before touching anything, when ``piece``
        or ``op`` is something it does not take (not C-contiguous or read-only, a dtype or op
        it cannot combine, AVG of integers): the caller takes the general path, which explains.

        It is also the small allreduce's fast path, for the executor's inline runner
        (``seq`` > 0: the collective's number, published on the progress board; ``limit`` is
        the runner's, checked by the caller). At 8 bytes the whole call has a budget of about
        a microsecond of Python, and every call, attribute lookup and view built on the way
        costs a tenth of one, so this is one closure over everything it touches, the views of
        the slots for the last kind of piece (shape, dtype, op) in its own variables, switched
        (``prepare``, views kept in ``self.memo``) when the kind changes.
        """
        transport, size = self, self.size
        # The round spins its spin_polls itself (below), then goes straight to the yielding wait.
        peers, own, wait = self._peer_controls, self._own_control, self._wait_yielding
        board = self.progress_board
        progress_slot = board.mine_slot if board is not None and board.mine_slot is not None else [0]
        fence_acquire, fence_release, loads_in_order = _fence_acquire, _fence_release, LOADS_IN_ORDER
        signals = (SLOT_SIGNAL, SLOT_SIGNAL + 8)
        spin = range(self.spin_polls)
        # The kind of the last piece and what a round of it needs (see prepare).
        shape = dtype = kind_op = None
        combine: Any = None
        mine: Sequence[np.ndarray] = ()
        first: Sequence[np.ndarray] = ()
        second: Sequence[np.ndarray] = ()
        rest: Sequence[Sequence[np.ndarray]] = ()
        nbytes = kind = whole = 0
        average = store_fence = False

        def prepare(piece, op) -> bool:
            nonlocal shape, dtype, kind_op, combine, mine, first, second, rest, nbytes, kind, whole
            nonlocal average, store_fence
            if op.__class__ is not ReduceOp:
                return False
            is_float = DTYPE_IS_FLOAT.get(piece.dtype)
            if is_float is None or (op is ReduceOp.AVG and not is_float):
                return False
            if piece.nbytes > self.layout.slot_bytes:
                raise ValueError(f"slot round of {piece.nbytes} bytes: slots hold {self.layout.slot_bytes}")
            key = ("slot_round", piece.shape, piece.dtype, op._value_)  # an Enum member's hash runs Python
            views = self.memo.get(key)
            if views is None:
                if len(self.memo) > 256:
                    self.memo.clear()
                views = self.memo[key] = self._slot_views(piece.shape, piece.dtype)
            shape, dtype, kind_op = piece.shape, piece.dtype, op
            mine, first, second, rest = views
            nbytes = transport.inline_nbytes = piece.nbytes  # the context, should it be needed
            kind = kind_code(dtype, op) << 44
            whole = kind | nbytes  # the signature when the round is the whole collective
            combine = getattr(self.xp, ufunc_name(op))
            if op is ReduceOp.MAX or op is ReduceOp.MIN:
                combine = _out_by_keyword(combine)
            average = op is ReduceOp.AVG
            store_fence = nbytes >= ORDERED_COPY_BYTES
            return True

        def slot_round(seq: int, _limit, piece, op, total_bytes=None) -> bool:
            if piece.shape != shape or piece.dtype is not dtype or op is not kind_op:
                if not prepare(piece, op):
                    return False
            flags = piece.flags  # as the general path: C-contiguous and writable, or its error
            if not (flags.c_contiguous and flags.writeable):
                return False
            epoch = transport._epoch + 1
            parity = epoch & 1
            mine[parity][...] = piece  # free to write: see "Reuse" in the module docstring
            signal = signals[parity]
            signature = whole if total_bytes is None else kind | total_bytes
            own[signal + 1] = signature
            if store_fence:
                fence_acquire()
                fence_release()
            own[signal] = epoch
            # The bookkeeping after the signal, not before: the peers wait for the signal, not
            # for it (the last rank to arrive makes everyone's time).
            transport._epoch = epoch
            if seq:
                progress_slot[0] = (seq << 8) | 1  # ProgressBoard.started(seq, "allreduce"), inlined
                transport.inline_seq = seq  # the context, should it be needed (see _current_context)
            for peer, control in peers:
                if control[signal] < epoch:
                    # Spin here, not in _wait: the rank that waits is the one whose exit is
                    # timed, and a call and its return would lie on its path after the peer's
                    # signal. Only a wait that outlasts the spin goes on to yield.
                    for _ in spin:
                        if control[signal] >= epoch:
                            break
                    else:
                        wait(peer, signal, epoch, "arrive")
                if not loads_in_order:  # read the signature after the signal
                    fence()
                if control[signal + 1] != signature:
                    transport._mismatch(peer, control[signal + 1] & _TOTAL_MASK, control[signal + 1] >> 44,
                                        nbytes if total_bytes is None else total_bytes, kind >> 44)
            # ``out`` positional: the keyword costs a ufunc 120 ns more (a tenth of the budget)
            combine(first[parity], second[parity], piece)
            for contribution in rest[parity]:
                combine(piece, contribution, piece)
            if average:
                piece /= size
            return True

        def forget() -> None:  # closing: drop the views of the slots, so the segments can be unmapped
            nonlocal shape, mine, first, second, rest
            shape, mine, first, second, rest = None, (), (), (), ()

        return slot_round, forget

    def _slot_views(self, shape: tuple, dtype) -> tuple:
        """``(mine, first, second, rest)`` by slot parity: this rank's slot, ranks 0's and 1's, the
        others' (in rank order), as arrays of ``shape`` and ``dtype`` (on the signal's line when
        they fit there: ``LINE_DATA_BYTES``)."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes <= LINE_DATA_BYTES:
            offsets = [(SLOT_SIGNAL + 8 * parity + 2) * 8 for parity in (0, 1)]
        else:
            offsets = [offset for offset, _ in self._areas[:2]]
        mine = [self._bytes[self.rank][offset:offset + nbytes].view(dtype).reshape(shape) for offset in offsets]
        everyone = [[self._bytes[peer][offset:offset + nbytes].view(dtype).reshape(shape)
                     for peer in range(self.size)] for offset in offsets]
        first, second = zip(*(pair[:2] for pair in everyone))
        return mine, first, second, [pair[2:] for pair in everyone]

    def claim_staging(self, epoch: int):
        """``(offset, bytes)``: this rank's staging half for ``epoch`` (see "Reuse")."""
        return self._area_arrays[2 + (epoch & 1)]

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
        control = self._own_control
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
        controls = self._controls
        for peer, control in self._peer_controls:
            if control[ARRIVE] < epoch:
                self._wait(peer, ARRIVE, epoch, "arrive")
        if not LOADS_IN_ORDER:
            fence()
        base = ARRIVE + 2 + 4 * (epoch & 1)
        offsets = []
        for peer in range(self.size):
            control = controls[peer]
            if (control[base + 1] != nbytes or control[base + 2] != kind
                    or control[base + 3] != total_bytes):
                self._mismatch(peer, control[base + 3], control[base + 2], total_bytes, kind)
            offsets.append(control[base])
        return offsets

    def publish_address(self, epoch: int, address: int) -> None:
        """The virtual address of this rank's buffer for ``epoch`` (before :meth:`arrive`, whose
        fence orders it before the arrival), for peers that copy by cross-memory attach."""
        self._own_control[ADDRESS + (epoch & 1)] = address

    def address_of(self, peer: int, epoch: int) -> int:
        """What ``peer`` published with :meth:`publish_address` for ``epoch`` (after its arrival)."""
        return self._controls[peer][ADDRESS + (epoch & 1)]

    def publish_output(self, epoch: int, offset: int) -> None:
        """Where this rank's output for ``epoch`` is in its segment, 0 where it is not (before
        :meth:`arrive`, as :meth:`publish_address`): peers may then write it."""
        self._own_control[OUTPUT + (epoch & 1)] = offset

    def output_of(self, peer: int, epoch: int) -> int:
        """What ``peer`` published with :meth:`publish_output` for ``epoch`` (after its arrival)."""
        return self._controls[peer][OUTPUT + (epoch & 1)]

    def peer_bytes(self, peer: int, offset: int, nbytes: int) -> np.ndarray:
        """Bytes ``[offset, offset + nbytes)`` of ``peer``'s segment (CommError if outside it)."""
        return self._view(peer, offset, nbytes, _BYTE)

    def staging_offset(self, epoch: int) -> int:
        """Where every rank's staging half for ``epoch`` starts in its segment."""
        return self._areas[2 + (epoch & 1)][0]

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
            array, start = self._bytes[peer], offset
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

    def _mismatch(self, peer: int, their_bytes: int, their_kind: int, nbytes: int, kind: int) -> None:
        raise CollectiveMismatchError(
            f"rank {self.ranks[self.rank]} on {self.hostname}: {self._current_context().describe()}: rank "
            f"{self.ranks[peer]} contributes {format_bytes(their_bytes)} of {_describe_kind(their_kind)}, "
            f"this rank {format_bytes(nbytes)} of {_describe_kind(kind)}; every rank must pass the same "
            f"size, dtype and op")

    # -- progress of a slice, and departure ----------------------------------------------------------
    def publish_progress(self, epoch: int, chunks: int) -> None:
        fence()
        self._own_control[PROGRESS] = (epoch << PROGRESS_BITS) | chunks

    def progress_of(self, peer: int, epoch: int) -> int:
        """How many chunks of its slice ``peer`` has published for ``epoch`` so far (no waiting)."""
        value = self._controls[peer][PROGRESS]
        if value >> PROGRESS_BITS != epoch:
            return 0
        if not LOADS_IN_ORDER:
            fence()
        return value & _CHUNKS_MASK

    def wait_progress(self, peer: int, epoch: int, chunks: int) -> None:
        target = (epoch << PROGRESS_BITS) | chunks
        if self._controls[peer][PROGRESS] < target:
            self._wait(peer, PROGRESS, target, "reduce the next chunk of its slice")
        if not LOADS_IN_ORDER:
            fence()

    def depart(self, wrote: bool = False) -> None:
        """This rank will not read any peer's memory for the current epoch (or earlier) any more;
        ``wrote``: nor write it, and what it wrote there is visible before the departure."""
        if wrote:
            fence()
        self._own_control[DONE] = self._epoch

    def wait_departed(self, epoch: int, what: str = "finish reading this rank's buffer") -> None:
        for peer, control in self._peer_controls:
            if control[DONE] < epoch:
                self._wait(peer, DONE, epoch, what)
        if not LOADS_IN_ORDER:  # the peers may have written this rank's buffer before departing
            fence()

    # -- waiting ------------------------------------------------------------------------------------
    def _wait(self, peer: int, word: int, target: int, what: str) -> None:
        control = self._controls[peer]
        for _ in range(self.spin_polls):  # a for over a range polls a third faster than a countdown
            if control[word] >= target:
                return
        self._wait_yielding(peer, word, target, what)

    def _wait_yielding(self, peer: int, word: int, target: int, what: str) -> None:
        control = self._controls[peer]
        sched_yield, monotonic = os.sched_yield, time.monotonic
        start = last_check = monotonic()
        deadline = self._current_context().deadline
        sleep_after = self._midway_sleep_after if word == PROGRESS or word == DONE else SLEEP_AFTER_SECONDS
        sleep = 2e-5
        polls = 0
        sleeper = FineSleeper()
        try:
            while control[word] < target:
                sched_yield()
                polls += 1
                if polls & 31:
                    continue
                now = monotonic()
                if now >= deadline:
                    if control[word] >= target:
                        return
                    self._raise_timeout(peer, word, target, what)
                if now - start > sleep_after:
                    sleeper.sleep(sleep)
                    sleep = min(sleep * 2, MAX_SLEEP_SECONDS)
                    if now - last_check > LIVENESS_EVERY_SECONDS:
                        last_check = now
                        gone = self._peer_gone(peer)
                        if gone and control[word] < target:
                            self._raise_lost(peer, word, target, what, gone)
                        if word in _ROUND_WORDS:
                            other = SLOT_SIGNAL + 8 * (target & 1) if word == ARRIVE else ARRIVE
                            if control[other] >= target and control[word] < target:
                                self._raise_other_round(peer, word, target)
        finally:
            sleeper.restore()

    def _raise_other_round(self, peer: int, word: int, target: int) -> None:
        """``peer`` began this epoch's round through the other counter: it runs another algorithm."""
        theirs, mine = ("an arrival round (shm_twoshot, shm_direct)", "a slot round (shm_oneshot)")
        if word == ARRIVE:
            theirs, mine = mine, theirs
        raise CollectiveMismatchError(
            f"rank {self.ranks[self.rank]} on {self.hostname}: {self._current_context().describe()}: rank "
            f"{self.ranks[peer]} runs shared-memory epoch {target} as {theirs}, this rank as {mine}: the "
            f"ranks chose different algorithms. With algorithm='auto' the choice depends on whether a "
            f"rank's buffer is symmetric (pg.alloc): pass symmetric buffers on every rank or on none, or "
            f"name the algorithm")

    def _peer_gone(self, peer: int) -> str:
        """Why ``peer``'s process can no longer make progress, or "" if it may still."""
        pid = self.pids[peer]
        if pid == os.getpid():
            return ""
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "its process no longer exists"
        except PermissionError:
            pass
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return "its process has exited"
        except (OSError, IndexError):
            pass
        return ""

    def _current_context(self):
        context = self.context
        if self.inline_seq > context.seq:  # the deadline counts from now: microseconds late
            context.begin("allreduce", self.inline_seq, "shm_oneshot", self.inline_nbytes, self.inline_timeout)
        return context

    def describe_peer(self, peer: int) -> str:
        """``rank R (pid P on HOST)``, for error messages."""
        return f"rank {self.ranks[peer]} (pid {self.pids[peer]} on {self.hostname})"

    def _waiting_for(self, peer: int, word: int, target: int, what: str) -> str:
        value = self._controls[peer][word]
        if word == PROGRESS:
            value_text = f"epoch {value >> PROGRESS_BITS} chunk {value & ((1 << PROGRESS_BITS) - 1)}"
            target_text = f"epoch {target >> PROGRESS_BITS} chunk {target & ((1 << PROGRESS_BITS) - 1)}"
        else:
            value_text, target_text = f"epoch {value}", f"epoch {target}"
        return (f"{self.describe_peer(peer)} to {what} (its counter is at {value_text}, waiting for "
                f"{target_text})")

    def _laggards(self) -> str:
        board = self.progress_board
        if board is None:
            return ""
        return f" [{board.laggards(self.context.seq, self.context.collective)}]"

    def _raise_timeout(self, peer: int, word: int, target: int, what: str) -> None:
        ctx = self._current_context()
        # A peer in this very collective that never arrived in shared memory may run it over MPI.
        hint = (" (a peer inside this collective may run it on another path: with algorithm='auto' "
                "a symmetric buffer (pg.alloc) on some ranks and a plain one on others choose "
                "differently)") if word in _ROUND_WORDS else ""
        raise CommTimeoutError(
            f"rank {self.ranks[self.rank]} on {self.hostname}: {ctx.describe()} timed out after "
            f"{ctx.timeout:g} s in shared memory waiting for {self._waiting_for(peer, word, target, what)}"
            f"{self._laggards()}{hint}")

    def _raise_lost(self, peer: int, word: int, target: int, what: str, gone: str) -> None:
        raise CommError(
            f"rank {self.ranks[self.rank]} on {self.hostname}: {self._current_context().describe()}: gave up "
            f"waiting in shared memory for {self._waiting_for(peer, word, target, what)}: {gone}"
            f"{self._laggards()}")

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
        self._bytes = []
        self._heap_bytes = []
        self._own_bytes = None
        for control in self._controls:
            control.release()
        self._controls = []
        self._peer_controls = []
        self._own_control = None  # type: ignore[assignment]  # closed: never read again
        for segment in self.segments + [heap for heap in self.heaps if heap is not None]:
            try:
                segment.close()
            except (BufferError, ValueError):  # arrays over it still alive: unmapped with the last one
                pass
        self.segments = []
        self.heaps = []
