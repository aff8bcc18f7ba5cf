"""The transport interface: the only thing a collective algorithm, or the group, may talk to.

An algorithm (``commlib/algorithms/*.py``) is a *schedule*: which slice of the buffer goes to
which peer at which step, and when partial results are combined. It never imports mpi4py or
cupy. It sees a :class:`Transport`, which offers

* ``rank``, ``size`` and ``xp`` (the array module of the buffers: numpy, or cupy on GPU);
* ``topology``: which ranks share a host (:class:`commlib.topology.Topology`), set by the
  group from what it discovered at creation; a transport nobody told is one host;
* ``post(sends, recvs)``: start every transfer of one step at once and return a
  :class:`Pending` whose ``wait()`` completes them (MPI: Isend/Irecv + Waitall with a deadline;
  NCCL: one ``groupStart/groupEnd`` on the comm stream, ``wait()`` is free because the stream
  orders the work);
* ``exchange(sends, recvs)``: ``post(...).wait()``;
* ``reduce(dst, src, op, src_first=False)``: the local element-wise combine;
* ``scratch(count, dtype, slot)``: a reusable work buffer owned by the transport, so pipelined
  algorithms need one chunk of extra memory, not a copy of the user's buffer;
* the library's own collectives, for the ``"native"`` algorithms: ``native_allreduce(buf, op)``,
  ``native_broadcast(buf, root)``, ``native_reduce(buf, root, op)``, ``native_allgather(out,
  inp)``, ``native_reduce_scatter(out, inp, op)``, ``native_barrier()`` (every transport
  implements these), and ``native_gather(out, inp, root)``, ``native_scatter(out, inp, root)``,
  ``native_alltoall(out, inp)``, ``native_alltoallv(out, inp, out_counts, in_counts)``, whose
  defaults here post every transfer of the collective in one step (what NCCL recommends for
  its missing alltoall); a transport whose library has them overrides them (MPI);
* ``concurrent_posts``: whether two threads may post at once, to disjoint pairs of ranks (MPI:
  yes, messages match per pair and tag; NCCL: no, every rank must call in one order);
* ``host_shared_memory``: None, or a shared-memory transport over this rank's peers on its host
  when the group spans hosts and has mapped their memory (the hierarchical allreduce runs its
  intra-host phases there, see :mod:`commlib.group.host_memory`).
* ``context`` (what the group is running: collective, sequence number, deadline; waits and
  error messages read it) and ``step(label)``, which names the schedule's step in it;
* ``memo``: a per-transport dict where an algorithm keeps what it derives once (views, plans).

And what the group itself uses, besides the above:

* ``progress_board``: set by the group; waits read it to name laggards and to give up when a
  peer's process exited;
* ``inline_native(collective, timeout)``: a cheap ``run(seq, limit, *args) -> bool`` for the
  group's small-message fast path (:mod:`commlib.group.fast_path`), or None (the default);
  ``inline_pair(collective, timeout)``: ``(algorithm, run)``, the same for one of our own
  schedules where it is a single message at two ranks, or None;
* ``split(member, key)`` and ``free_communicator()``: the group's sub-groups and its teardown
  (MPI: ``MPI_Comm_split``, ``MPI_Comm_free``), so that the group never calls the library.

Sends and receives are ``(buffer_slice, peer)`` pairs; slices must be contiguous views of
1-D arrays. Between ``post`` and ``wait`` an algorithm may do local work (reduce the previous
segment while the next one is in flight): that is how the pipelined schedules overlap.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Tuple

from commlib.ops import ReduceOp, reduce_into, reduce_ordered
from commlib.rendezvous.interface import Rendezvous
from commlib.topology import Topology
from commlib.units import format_bytes

if TYPE_CHECKING:
    from commlib.reliability.progress_board import ProgressBoard

__all__ = ["Transport", "Pending", "CompletedPending", "CollectiveContext", "Transfer", "format_bytes"]

Transfer = Tuple[object, int]  # (contiguous 1-D buffer slice, peer rank)


@dataclasses.dataclass
class CollectiveContext:
    """What the group is doing right now; transports put it in their error messages."""

    collective: str = "idle"
    seq: int = 0
    algorithm: str = ""
    nbytes: int = 0
    deadline: float = float("inf")
    timeout: float = float("inf")
    step: str = ""

    def begin(self, collective: str, seq: int, algorithm: str, nbytes: int, timeout: float) -> None:
        """Collective number ``seq`` starts now: its deadline is ``timeout`` seconds from here."""
        self.collective, self.seq, self.algorithm, self.nbytes, self.step = collective, seq, algorithm, nbytes, ""
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout

    def describe(self) -> str:
        algo = f", {self.algorithm}" if self.algorithm else ""
        step = f", {self.step}" if self.step else ""
        return f"{self.collective} #{self.seq}{algo}{step}, {format_bytes(self.nbytes)}"




class Pending(abc.ABC):
    """Transfers of one step, started and not yet known to be complete."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until every transfer of the step completed, or raise ``CommTimeoutError``."""


class CompletedPending(Pending):
    def wait(self) -> None:
        return None


class Transport(abc.ABC):
    """Everything an algorithm, and the group, may use of a transport (see the module docstring).

    An implementation sets ``rank``, ``size`` and ``xp``, implements :meth:`post`, and overrides
    what its library does better than the defaults here. The ``shm_*`` algorithms need more
    (the peers' memory): they are written against :class:`commlib.transports.shm.
    SharedMemoryTransport`, which adds those operations, and say so with
    ``requires_shared_memory``.
    """

    #: This rank's number among the transport's ranks, and how many there are.
    rank: int
    size: int
    #: The array module of the buffers (numpy; cupy on GPU): scratch buffers and the local reduce.
    xp: Any
    #: Whether two threads may post at once, to disjoint pairs of ranks (MPI: yes, messages match
    #: per pair and tag; NCCL: no, every rank must call in one order).
    concurrent_posts: bool = False
    #: Whether messages between two ranks of one host move through shared memory (MPI's do):
    #: then the library-style schedules (ring, rabenseifner) compete with the ``shm_*`` ones and
    #: the selector's one-host tables weigh them; over loopback sockets they never win.
    local_messages_in_shared_memory: bool = False
    #: Set by the group: None, or a shared-memory transport over this rank's peers on its host
    #: when the group spans hosts and mapped their memory (hierarchical's intra-host phases).
    host_shared_memory: Optional[Transport] = None
    #: How this transport's ranks met (:mod:`commlib.rendezvous`), for a transport that builds its
    #: own connections (sockets): a group over it sets itself up through it. None for MPI's (the
    #: group makes its rendezvous from the communicator) and for views.
    rendezvous: Optional[Rendezvous] = None
    #: Set by the group: its :class:`commlib.reliability.progress_board.ProgressBoard` (who started which
    #: collective), which waits read to name laggards and to give up on a peer that exited.
    progress_board: Optional[ProgressBoard] = None

    def __init__(self) -> None:
        #: What the group is doing now (collective, sequence number, deadline): the group sets
        #: it before each collective; waits read the deadline, errors quote it.
        self.context = CollectiveContext()
        self._scratch: Dict[Tuple[int, str], Any] = {}
        #: What an algorithm derives once per transport (views, plans), under its own keys.
        self.memo: Dict[Any, Any] = {}
        self._topology: Optional[Topology] = None

    @property
    def topology(self) -> Topology:
        """Which ranks share a host (set by the group); one host when nobody said otherwise."""
        topology = self._topology
        if topology is None or topology.size != self.size:
            return Topology.single_host(self.rank, self.size)
        return topology

    @topology.setter
    def topology(self, topology: Topology) -> None:
        self._topology = topology

    # -- moving bytes -------------------------------------------------------------------------
    @abc.abstractmethod
    def post(self, sends: Sequence[Transfer] = (), recvs: Sequence[Transfer] = ()) -> Pending:
        """Start all ``sends`` and ``recvs`` of one step; complete them with ``wait()``."""

    def exchange(self, sends: Sequence[Transfer] = (), recvs: Sequence[Transfer] = ()) -> None:
        """One step, waited: ``post(sends, recvs).wait()``."""
        self.post(sends, recvs).wait()

    def send(self, buf, peer: int) -> None:
        self.exchange(sends=((buf, peer),))

    def recv(self, buf, peer: int) -> None:
        self.exchange(recvs=((buf, peer),))

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int) -> None:
        self.exchange(sends=((sendbuf, dst),), recvs=((recvbuf, src),))

    # -- the library's collectives on the caller's thread (the group's small-message fast path) --
    def inline_native(self, collective: str, timeout: float):
        """A function ``run(seq, limit, *args) -> bool`` that runs ``native_<collective>(*args)``
        as collective number ``seq`` right away on the caller's thread, cheaper than the general
        path, or None.

        The group asks once per collective and calls it from its small-message fast path, under
        the executor's issue lock with nothing else in line (see :mod:`commlib.group.fast_path`).
        ``run`` first decides whether it takes the call (plain host buffers it can hand to its
        library as they are, valid arguments, at most ``limit`` bytes as ``auto`` keys the
        collective) and returns False without touching anything if not: the general path then
        validates and explains. When it takes the call it must keep the general path's
        semantics: mark ``progress_board`` (if any) started, give up after ``timeout`` seconds
        with the same errors, name the collective and ``seq`` in them; and return True. The
        default, None, leaves every call to the general path.
        """
        return None

    def inline_pair(self, collective: str, timeout: float):
        """``(algorithm, run)``: like :meth:`inline_native`, but ``run`` does what our algorithm
        ``algorithm`` does for ``collective`` between two ranks (one message), sending exactly
        the messages the general path's ``algorithm`` sends, so that ranks on either path
        match. None (the default) where there is no such path."""
        return None

    # -- the library's own collectives (the "native" algorithms) -----------------------------
    # Every transport that runs whole collectives implements these six (MPI, NCCL, host-staged,
    # in-process); views and the shared-memory transport, which only carry schedules, do not.
    def native_allreduce(self, buf, op: ReduceOp) -> None:
        """``buf`` becomes the reduction of every rank's, in place."""
        self._no_native("allreduce")

    def native_broadcast(self, buf, root: int) -> None:
        """Every rank's ``buf`` becomes ``root``'s."""
        self._no_native("broadcast")

    def native_reduce(self, buf, root: int, op: ReduceOp) -> None:
        """``root``'s ``buf`` becomes the reduction of every rank's; the others' stay as they were."""
        self._no_native("reduce")

    def native_allgather(self, out, inp) -> None:
        """``out`` (``size`` blocks of ``inp.size``) gets every rank's ``inp``, rank-major."""
        self._no_native("allgather")

    def native_reduce_scatter(self, out, inp, op: ReduceOp) -> None:
        """Rank ``r``'s ``out`` gets block ``r`` of the reduction of every rank's ``inp``."""
        self._no_native("reduce_scatter")

    def native_barrier(self) -> None:
        """Returns once every rank entered it."""
        self._no_native("barrier")

    def _no_native(self, collective: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no native {collective} (it carries "
                                  f"schedules only); use a schedule, or the group's own transport")

    # -- the library's collectives that not every library has: one step of every transfer ------
    def native_gather(self, out, inp, root: int) -> None:
        block = inp.size
        if block == 0:
            return
        if self.rank != root:
            self.exchange(sends=((inp, root),))
            return
        self.copy(out[root * block:(root + 1) * block], inp)
        self.exchange(recvs=[(out[peer * block:(peer + 1) * block], peer)
                             for peer in range(self.size) if peer != root])

    def native_scatter(self, out, inp, root: int) -> None:
        block = out.size
        if block == 0:
            return
        if self.rank != root:
            self.exchange(recvs=((out, root),))
            return
        self.copy(out, inp[root * block:(root + 1) * block])
        self.exchange(sends=[(inp[peer * block:(peer + 1) * block], peer)
                             for peer in range(self.size) if peer != root])

    def native_alltoall(self, out, inp) -> None:
        block = inp.size // self.size
        counts = (block,) * self.size
        self.native_alltoallv(out, inp, counts, counts)

    def native_alltoallv(self, out, inp, out_counts, in_counts) -> None:
        rank = self.rank
        out_offsets, in_offsets = _prefix_sums(out_counts), _prefix_sums(in_counts)
        sends = [(inp[in_offsets[peer]:in_offsets[peer + 1]], peer) for peer in range(self.size)
                 if peer != rank and in_counts[peer]]
        recvs = [(out[out_offsets[peer]:out_offsets[peer + 1]], peer) for peer in range(self.size)
                 if peer != rank and out_counts[peer]]
        pending = self.post(sends, recvs)
        if in_counts[rank]:
            self.copy(out[out_offsets[rank]:out_offsets[rank + 1]], inp[in_offsets[rank]:in_offsets[rank + 1]])
        pending.wait()

    # -- local work ---------------------------------------------------------------------------
    def reduce(self, dst, src, op: ReduceOp, src_first: bool = False) -> None:
        """``dst = dst (op) src``; with ``src_first`` the operands are evaluated as ``src (op) dst``."""
        if src_first:
            reduce_ordered(self.xp, dst, src, op, src_first=True)
        else:
            reduce_into(self.xp, dst, src, op)

    def copy(self, dst, src) -> None:
        """``dst[...] = src`` on the transport's device (and stream)."""
        dst[...] = src

    def scratch(self, count: int, dtype, slot: int = 0):
        """A work buffer of ``count`` elements, reused across calls (grown when too small)."""
        key = (slot, self.xp.dtype(dtype).str)
        buf = self._scratch.get(key)
        if buf is None or buf.size < count:
            buf = self.xp.empty(max(count, 1), dtype=dtype)
            self._scratch[key] = buf
        return buf[:count]

    def scratch_bytes(self) -> int:
        """Bytes the transport's scratch buffers hold now (what a schedule cost in extra memory)."""
        return sum(buf.nbytes for buf in self._scratch.values())

    def release_scratch(self) -> None:
        """Drop the scratch buffers and the memo (at close)."""
        self._scratch.clear()
        self.memo.clear()

    # -- the group's ranks ------------------------------------------------------------------
    def split(self, member: bool, key: int):
        """Collective: what a new group of the ranks with ``member`` (ordered by ``key``) is built
        on (MPI: its communicator), None on the other ranks. Blocking, but bounded by the
        context's deadline. Only transports a group is created over implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot create sub-groups")

    def interrupt(self, error: Exception) -> None:
        """From any thread: the collective in progress, and every later one, ends with ``error``.
        Only transports that can stop a wait from outside implement it (sockets); MPI cannot end
        one communicator's collective."""
        raise NotImplementedError(f"{type(self).__name__} cannot be interrupted")

    def free_communicator(self) -> None:  # noqa: B027 - optional: most transports hold nothing of the kind
        """Release what ties the transport to its ranks (MPI: the communicator), last, at the
        group's close. Local and idempotent; nothing by default."""

    def releaser(self):
        """A callable that does :meth:`free_communicator`'s work without a reference to this
        transport's group (run when the group is collected unclosed). By default
        ``free_communicator`` itself."""
        return self.free_communicator

    def step(self, label: str) -> None:
        """Name the current step of the schedule, for error messages."""
        self.context.step = label

    def close(self) -> None:
        """Release the transport's buffers (not its ranks: :meth:`free_communicator`)."""
        self.release_scratch()


def _prefix_sums(counts):
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets
