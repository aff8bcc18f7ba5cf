"""The transport interface: the only thing a collective algorithm may talk to.

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
  intra-host phases there, see :mod:`commlib.host_memory`).

Sends and receives are ``(buffer_slice, peer)`` pairs; slices must be contiguous views of
1-D arrays. Between ``post`` and ``wait`` an algorithm may do local work (reduce the previous
segment while the next one is in flight): that is how the pipelined schedules overlap.
"""

from __future__ import annotations

import abc
import dataclasses
import time
from typing import Any, Dict, Optional, Sequence, Tuple

from .ops import ReduceOp, reduce_into, reduce_ordered
from .topology import Topology

__all__ = ["Transport", "Pending", "CompletedPending", "CollectiveContext", "Transfer"]

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

    def set(self, collective: str, seq: int, algorithm: str, nbytes: int, timeout: float) -> None:
        """A new collective starts now (the deadline counts from here)."""
        self.collective, self.seq, self.algorithm, self.nbytes, self.step = collective, seq, algorithm, nbytes, ""
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout

    def describe(self) -> str:
        algo = f", {self.algorithm}" if self.algorithm else ""
        step = f", {self.step}" if self.step else ""
        return f"{self.collective} #{self.seq}{algo}{step}, {format_bytes(self.nbytes)}"


def format_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


class Pending(abc.ABC):
    """Transfers of one step, started and not yet known to be complete."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until every transfer of the step completed, or raise ``CommTimeoutError``."""


class CompletedPending(Pending):
    def wait(self) -> None:
        return None


class Transport(abc.ABC):
    rank: int
    size: int
    xp: Any  # the array module
    concurrent_posts: bool = False
    host_shared_memory: Optional[Transport] = None

    def __init__(self) -> None:
        self.context = CollectiveContext()
        self._scratch: Dict[Tuple[int, str], Any] = {}
        self.memo: Dict[Any, Any] = {}  # what an algorithm derives once per transport (views, plans), by its own keys
        self._topology: Optional[Topology] = None

    @property
    def topology(self) -> Topology:
        """Which ranks share a host; one host when nobody said otherwise."""
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
        self.post(sends, recvs).wait()

    def send(self, buf, peer: int) -> None:
        self.exchange(sends=((buf, peer),))

    def recv(self, buf, peer: int) -> None:
        self.exchange(recvs=((buf, peer),))

    def sendrecv(self, sendbuf, dst: int, recvbuf, src: int) -> None:
        self.exchange(sends=((sendbuf, dst),), recvs=((recvbuf, src),))

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
        dst[...] = src

    def scratch(self, count: int, dtype, slot: int = 0):
        """A work buffer of ``count`` elements, reused across calls (grown when too small)."""
        key = (slot, self.xp.dtype(dtype).str)
        buf = self._scratch.get(key)
        if buf is None or buf.size < count:
            buf = self.xp.empty(max(count, 1), dtype=dtype)
            self._scratch[key] = buf
        return buf[:count]

    def release_scratch(self) -> None:
        self._scratch.clear()
        self.memo.clear()

    def step(self, label: str) -> None:
        """Name the current step of the schedule, for error messages."""
        self.context.step = label

    def close(self) -> None:
        self.release_scratch()


def _prefix_sums(counts):
    offsets = [0]
    for count in counts:
        offsets.append(offsets[-1] + count)
    return offsets
