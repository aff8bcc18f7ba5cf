"""An in-process transport: ``p`` ranks as ``p`` threads of one process, for fast schedule tests.

It implements the :class:`commlib.transports.interface.Transport` interface with per-pair mailboxes, so an
algorithm runs unchanged at any world size in milliseconds, and it can record every send
(step label, source, destination, bytes) for structural tests of a schedule.

It is stricter than MPI where MPI would merely be undefined: a send's bytes are taken at
``post`` and checked again at ``wait`` (a schedule that writes a buffer still in flight fails),
a received message lands only at ``wait`` (a schedule that reads it earlier sees stale data),
and a size mismatch between a send and its receive is an error, not a truncation. Receives
from one peer match that peer's sends in posting order, as MPI's do for one tag.

Usage::

    world = InProcessWorld(4, record=True)
    world.run(lambda transport: allreduce_ring(transport, bufs[transport.rank], ReduceOp.SUM))
    world.records  # [SendRecord(step=..., src=0, dst=1, nbytes=...), ...]

``hosts`` emulates a topology (``transport.topology``): ``InProcessWorld(6, hosts=[3, 2, 1])``
puts ranks 0-2, 3-4 and 5 on three hosts; ``hosts=[[0, 2, 4], [1, 3, 5]]`` places them
round-robin. Default: one host.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from commlib.errors import CommError, CommTimeoutError
from commlib.ops import ReduceOp
from commlib.topology import Topology
from commlib.transports.interface import Pending, Transfer, Transport
from commlib.units import format_bytes

__all__ = ["InProcessWorld", "InProcessTransport", "SendRecord"]


class SendRecord(NamedTuple):
    step: str
    src: int
    dst: int
    nbytes: int


def _raw(buf) -> np.ndarray:
    return buf.reshape(-1).view(np.uint8)


class InProcessWorld:
    """The shared state of ``size`` thread-ranks: mailboxes, the send log, the first failure."""

    def __init__(self, size: int, *, timeout: float = 10.0, record: bool = False, hosts=None):
        if size < 1:
            raise ValueError(f"InProcessWorld: size must be >= 1, got {size}")
        self.size = size
        self.topology = Topology.from_shape(0, hosts if hosts is not None else [size])
        if self.topology.size != size:
            raise ValueError(f"InProcessWorld: hosts {hosts} hold {self.topology.size} ranks, not {size}")
        self.timeout = timeout
        self.recording = record
        self.records: List[SendRecord] = []
        # One condition per receiving rank: a delivery wakes only the rank it is for.
        self._conds = [threading.Condition() for _ in range(size)]
        # (src, dst) -> {message number: bytes}; numbers count sends / receives per pair.
        self._mail: Dict[tuple, Dict[int, np.ndarray]] = {}
        self._sent: Dict[tuple, int] = {}
        self._received: Dict[tuple, int] = {}
        self.failure: Optional[BaseException] = None
        self.failed_rank = -1
        self.transports = [InProcessTransport(self, rank) for rank in range(size)]

    # -- called by the transports --------------------------------------------------------------
    def deliver(self, src: int, dst: int, data: np.ndarray, step: str) -> None:
        cond = self._conds[dst]
        with cond:
            number = self._sent.get((src, dst), 0)
            self._sent[(src, dst)] = number + 1
            self._mail.setdefault((src, dst), {})[number] = data
            if self.recording:
                self.records.append(SendRecord(step, src, dst, data.nbytes))
            cond.notify_all()

    def ticket(self, src: int, dst: int) -> int:
        with self._conds[dst]:
            number = self._received.get((src, dst), 0)
            self._received[(src, dst)] = number + 1
            return number

    def collect(self, src: int, dst: int, number: int, deadline: float, transport) -> np.ndarray:
        cond = self._conds[dst]
        with cond:
            while True:
                box = self._mail.get((src, dst), {})
                if number in box:
                    return box.pop(number)
                if self.failure is not None:
                    raise CommError(
                        f"rank {dst}: {transport.context.describe()}: gave up waiting for rank "
                        f"{src} because rank {self.failed_rank} failed: {self.failure}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CommTimeoutError(
                        f"rank {dst}: {transport.context.describe()} timed out after "
                        f"{transport.context.timeout:g} s waiting for message #{number} from rank {src}")
                cond.wait(min(remaining, 0.05))

    def fail(self, rank: int, exc: BaseException) -> None:
        for cond in self._conds:
            with cond:
                if self.failure is None:
                    self.failure, self.failed_rank = exc, rank
                cond.notify_all()

    # -- running a schedule --------------------------------------------------------------------
    def run(self, fn: Callable[[Transport], object], *, collective: str = "allreduce",
            algorithm: str = "", nbytes: int = 0) -> list:
        """Call ``fn(transport)`` on every rank, one thread each; return the per-rank results.

        Re-raises the first rank's exception (others then fail fast instead of timing out).
        """
        results: list = [None] * self.size
        errors: list = [None] * self.size

        def body(rank: int) -> None:
            transport = self.transports[rank]
            context = transport.context
            context.begin(collective, context.seq + 1, algorithm, nbytes, self.timeout)
            try:
                results[rank] = fn(transport)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors[rank] = exc
                self.fail(rank, exc)

        threads = [threading.Thread(target=body, args=(rank,), name=f"inprocess-rank-{rank}", daemon=True)
                   for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(self.timeout + 5.0)
            if thread.is_alive():
                raise CommTimeoutError(f"in-process world: {thread.name} still running after "
                                       f"{self.timeout + 5.0:g} s")
        if self.failure is not None:
            raise self.failure
        leftover = {pair: len(box) for pair, box in self._mail.items() if box}
        if leftover:
            raise CommError(f"in-process world: messages sent but never received: {leftover}")
        return results


class _InProcessPending(Pending):
    __slots__ = ("transport", "sends", "recvs")

    def __init__(self, transport, sends, recvs):
        self.transport = transport
        self.sends = sends  # (buffer, peer, bytes at post time)
        self.recvs = recvs  # (buffer, peer, message number)

    def wait(self) -> None:
        transport = self.transport
        world, rank = transport.world, transport.rank
        for buf, peer, number in self.recvs:
            data = world.collect(peer, rank, number, transport.context.deadline, transport)
            if data.nbytes != buf.nbytes:
                raise CommError(
                    f"rank {rank}: {transport.context.describe()}: receive of "
                    f"{format_bytes(buf.nbytes)} from rank {peer} matched a send of "
                    f"{format_bytes(data.nbytes)}; expected equal sizes")
            _raw(buf)[...] = data
        for buf, peer, snapshot in self.sends:
            if not np.array_equal(_raw(buf), snapshot):
                raise CommError(
                    f"rank {rank}: {transport.context.describe()}: the buffer of a send to rank "
                    f"{peer} ({format_bytes(buf.nbytes)}) was modified before the send completed")
        self.sends = self.recvs = ()


class InProcessTransport(Transport):
    xp = np
    concurrent_posts = True

    def __init__(self, world: InProcessWorld, rank: int):
        super().__init__()
        self.world = world
        self.rank = rank
        self.size = world.size
        self.topology = world.topology.for_rank(rank)

    def _check_peer(self, peer: int, what: str) -> None:
        if not 0 <= peer < self.size or peer == self.rank:
            raise CommError(f"rank {self.rank}: {self.context.describe()}: {what} peer {peer} is not "
                            f"another rank of a world of {self.size}")

    def post(self, sends: Sequence[Transfer] = (), recvs: Sequence[Transfer] = ()) -> Pending:
        posted_recvs = []
        for buf, peer in recvs:
            self._check_peer(peer, "receive")
            posted_recvs.append((buf, peer, self.world.ticket(peer, self.rank)))
        posted_sends = []
        for buf, peer in sends:
            self._check_peer(peer, "send")
            snapshot = _raw(buf).copy()
            self.world.deliver(self.rank, peer, snapshot, self.context.step)
            posted_sends.append((buf, peer, snapshot))
        return _InProcessPending(self, posted_sends, posted_recvs)

    # -- the "library's own" collectives, built from point-to-point all-to-all ----------------
    def _gather_all(self, buf) -> List[np.ndarray]:
        """Every rank's copy of ``buf``, indexed by rank."""
        copies = [buf.reshape(-1)] * self.size  # the peers' entries are replaced below
        recvs = []
        for peer in range(self.size):
            if peer != self.rank:
                copies[peer] = np.empty_like(buf.reshape(-1))
                recvs.append((copies[peer], peer))
        self.step("native all-to-all")
        self.exchange([(buf.reshape(-1), peer) for peer in range(self.size) if peer != self.rank], recvs)
        return copies

    def _reduce_ranks(self, copies, op: ReduceOp) -> np.ndarray:
        total = copies[0].copy()
        for other in copies[1:]:
            self.reduce(total, other, op)
        return total

    def native_allreduce(self, buf, op: ReduceOp) -> None:
        if buf.size:
            self.copy(buf, self._reduce_ranks(self._gather_all(buf), op).reshape(buf.shape))

    def native_broadcast(self, buf, root: int) -> None:
        self.step("native broadcast")
        if self.rank == root:
            self.exchange([(buf, peer) for peer in range(self.size) if peer != root], ())
        else:
            self.recv(buf, root)

    def native_reduce(self, buf, root: int, op: ReduceOp) -> None:
        self.step("native reduce")
        if self.rank != root:
            self.send(buf, root)
            return
        copies = [np.empty_like(buf) if peer != root else buf for peer in range(self.size)]
        self.exchange((), [(copies[peer], peer) for peer in range(self.size) if peer != root])
        self.copy(buf, self._reduce_ranks(copies, op))

    def native_allgather(self, out, inp) -> None:
        block = inp.size
        for peer, copy in enumerate(self._gather_all(inp)):
            self.copy(out[peer * block:(peer + 1) * block], copy)

    def native_reduce_scatter(self, out, inp, op: ReduceOp) -> None:
        block = out.size
        mine = [copy[self.rank * block:(self.rank + 1) * block] for copy in self._gather_all(inp)]
        self.copy(out, self._reduce_ranks(mine, op))

    def native_barrier(self) -> None:
        empty = np.empty(0, np.uint8)
        self._gather_all(empty)
