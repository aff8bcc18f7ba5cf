"""Point-to-point messages of a group: send, recv, isend, irecv, and a monitored barrier.

Why a communicator of its own: collectives match their messages by tag (the sequence number mod
32768) on the group's communicator, so a user's tag-5 message, or any ``ANY_SOURCE`` receive,
posted there could match a collective's. MPI matches messages only within one communicator, so
point-to-point traffic gets its own, created collectively with the group (``MPI_Comm_idup``
waited with the group's deadline): no tag or wildcard can cross between the two. Point-to-point
is not collective: it takes no sequence number from the group and never queues in the group's
line of collectives, so a blocked ``recv`` stalls neither the comm thread nor the collectives
another thread issues.

Blocking ``send``/``recv`` post and wait in the caller's thread. ``isend``/``irecv`` post in the
caller's thread too (so two messages between the same ranks with the same tag keep program
order, MPI's non-overtaking rule) and return a :class:`P2PWork`; a progress thread, started on
first use, tests their requests and completes the works (running their callbacks). Every
operation has a deadline (the group's timeout, or ``timeout=``): a receive that times out is
cancelled, so no late message lands in a buffer the caller took back, and the error names this
rank, the peer, the tag and the bytes. A wait for a peer on this host whose process exited ends
sooner, with :class:`PeerExitedError` (read from the group's progress board, as collective waits
do). Errors do not poison the group: nothing collective is left half done. Buffers are numpy
arrays: a CuPy array is refused before anything is sent.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from typing import List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from commlib.errors import CommError, CommTimeoutError, GroupAbortedError, InvalidUsageError, PeerExitedError
from commlib.execution.work import Work
from commlib.group.validation import array_kind, check_buffer, check_peer, check_tag, check_timeout
from commlib.platform.backoff import next_sleep
from commlib.platform.machine import polls_per_yield
from commlib.platform.timer_slack import fine_timer_slack
from commlib.platform.waiting import GIVE_UP_CHECK_SECONDS, MAX_SLEEP_SECONDS, SLEEP_AFTER_SECONDS, wait_all
from commlib.reliability.teardown import release_later
from commlib.transports.mpi.transport import as_bytes
from commlib.units import format_bytes

__all__ = ["ANY_SOURCE", "P2PWork", "PointToPoint"]

ANY_SOURCE = -1
# Seconds a send whose deadline passed may take to acknowledge its cancellation.
CANCEL_GRACE_SECONDS = 0.05


class P2PWork(Work):
    """The handle of an ``isend``/``irecv``; ``source`` is the sender once a receive completed.

    Its ``seq`` numbers this group's point-to-point operations, not its collectives.
    """

    __slots__ = ("source",)

    def __init__(self, kind: str, number: int, nbytes: int, result):
        super().__init__(kind, number, nbytes, result)
        self.source: Optional[int] = None


class _Operation:
    __slots__ = ("kind", "number", "buf", "peer", "tag", "timeout", "deadline", "request", "status", "work")

    def __init__(self, kind, number, buf, peer, tag, timeout, request, work=None):
        self.kind, self.number, self.buf, self.peer, self.tag = kind, number, buf, peer, tag
        self.timeout, self.deadline = timeout, time.monotonic() + timeout
        self.request, self.status, self.work = request, MPI.Status(), work


class PointToPoint:
    """The point-to-point channel of one group (see the module docstring)."""

    def __init__(self, comm: MPI.Comm, *, timeout: float, name: str, progress_board=None):
        self.rank, self.size, self.name = comm.Get_rank(), comm.Get_size(), name
        self.timeout = timeout
        self.progress_board = progress_board  # the group's: which on-node peers have exited
        self.comm = _dup_with_deadline(comm, timeout, name)
        # As for the group's communicator (commlib.reliability.teardown): freed after a collection
        # without close(), at the next safe point, never inside the collection; at exit the group's
        # close() frees it.
        weakref.finalize(self, release_later(functools.partial(_free_quietly, self.comm))).atexit = False
        # User tags take the lower half of the MPI library's tag range, the monitored barrier
        # the upper half, so the two can never match each other.
        tag_ub = self.comm.Get_attr(MPI.TAG_UB)
        assert tag_ub is not None  # the standard guarantees TAG_UB on every communicator
        self.tag_limit = (int(tag_ub) + 1) // 2
        self._numbers = 0
        self._barriers = 0
        self._lock = threading.Condition()
        self._pending: List[_Operation] = []
        self._abandoned: List[_Operation] = []  # timed-out sends MPI could not cancel
        self._thread: Optional[threading.Thread] = None
        self._closed = False

    # -- blocking ------------------------------------------------------------------------------
    def send(self, buf, dst: int, tag: int = 0, timeout: Optional[float] = None) -> None:
        operation = self._post("send", buf, dst, tag, timeout)
        self._wait_here(operation)

    def recv(self, buf, src: int, tag: int = 0, timeout: Optional[float] = None) -> int:
        operation = self._post("recv", buf, src, tag, timeout)
        return self._wait_here(operation)

    # -- nonblocking ---------------------------------------------------------------------------
    def isend(self, buf, dst: int, tag: int = 0, timeout: Optional[float] = None) -> P2PWork:
        return self._track(self._post("send", buf, dst, tag, timeout))

    def irecv(self, buf, src: int, tag: int = 0, timeout: Optional[float] = None) -> P2PWork:
        return self._track(self._post("recv", buf, src, tag, timeout))

    # -- the monitored barrier -----------------------------------------------------------------
    def monitored_barrier(self, timeout: Optional[float] = None, wait_all_ranks: bool = False) -> None:
        """Rank 0 waits up to ``timeout`` for every rank, then tells each who did not arrive.

        Raises :class:`CommTimeoutError` naming the missing ranks (all of them with
        ``wait_all_ranks``, else the lowest) on rank 0 and on every rank that arrived; a rank
        that arrives late, or waits for a rank 0 that never came, times out naming rank 0. The
        other ranks wait up to twice ``timeout`` for rank 0's verdict: rank 0 may arrive up to
        ``timeout`` after them and then wait ``timeout`` itself.
        """
        timeout = self.timeout if timeout is None else check_timeout(timeout, "monitored_barrier")
        self._check_open()
        number = self._barriers = self._barriers + 1
        what = f"rank {self.rank}: monitored_barrier #{number} (group {self.name!r})"
        if self.size == 1:
            return
        tag = self.tag_limit + number % self.tag_limit
        deadline = time.monotonic() + timeout
        if self.rank != 0:
            token, verdict = np.ones(1, np.uint8), np.zeros(self.size, np.uint8)
            requests = [self.comm.Isend(as_bytes(token), 0, tag), self.comm.Irecv(as_bytes(verdict), 0, tag)]
            if not wait_all(requests, deadline + timeout):
                _cancel_quietly(requests)
                raise CommTimeoutError(f"{what} timed out after {2 * timeout:g} s waiting for rank 0 to "
                                       f"release it (rank 0 did not arrive, or this rank came too late)")
            missing = [peer for peer in range(self.size) if verdict[peer]]
            if missing:
                raise CommTimeoutError(f"{what}: rank(s) {_ranks(missing)} did not arrive within "
                                       f"{timeout:g} s (as rank 0 saw it)")
            return
        tokens = np.zeros(self.size, np.uint8)
        requests = [self.comm.Irecv(as_bytes(tokens[peer:peer + 1]), peer, tag) for peer in range(1, self.size)]
        wait_all(requests, deadline)
        late = [peer for peer, request in zip(range(1, self.size), requests) if not request.Test()]
        _cancel_quietly([request for peer, request in zip(range(1, self.size), requests) if peer in late])
        verdict = np.zeros(self.size, np.uint8)
        verdict[late if wait_all_ranks else late[:1]] = 1
        arrived = [peer for peer in range(1, self.size) if peer not in late]
        releases = [self.comm.Isend(as_bytes(verdict), peer, tag) for peer in arrived]
        if not wait_all(releases, time.monotonic() + timeout):  # small, so normally sent at once
            _cancel_quietly(releases)
        if late:
            shown = late if wait_all_ranks else late[:1]
            raise CommTimeoutError(f"{what}: rank(s) {_ranks(shown)} did not arrive within {timeout:g} s"
                                   + ("" if wait_all_ranks or len(late) == 1 else
                                      " (the lowest of the missing; wait_all_ranks=True names all)"))

    # -- internals -----------------------------------------------------------------------------
    def _post(self, kind: str, buf, peer, tag, timeout) -> _Operation:
        what = f"{kind} (group {self.name!r})"
        if array_kind(buf) != "numpy":
            raise InvalidUsageError(f"{what}: rank {self.rank}: point-to-point takes numpy arrays, got a "
                                    f"{type(buf).__module__}.{type(buf).__name__} of {buf.nbytes} bytes for "
                                    f"rank {peer}; copy a GPU array to the host first (nothing was sent)")
        flat = check_buffer(buf, kind, writable=kind == "recv")
        peer = check_peer(peer, self.size, self.rank, what, any_source=ANY_SOURCE if kind == "recv" else None)
        tag = check_tag(tag, self.tag_limit, what)
        timeout = self.timeout if timeout is None else check_timeout(timeout, kind)
        self._check_open()
        with self._lock:
            self._numbers += 1
            number = self._numbers
        if kind == "send":
            request = self.comm.Isend(as_bytes(flat), peer, tag)
        else:
            request = self.comm.Irecv(as_bytes(flat), MPI.ANY_SOURCE if peer == ANY_SOURCE else peer, tag)
        return _Operation(kind, number, flat, peer, tag, timeout, request)

    def _wait_here(self, operation: _Operation):
        gone: List[int] = []

        def give_up() -> bool:
            gone[:] = self._peers_gone(operation)
            return bool(gone)

        if not wait_all([operation.request], operation.deadline, give_up, statuses=[operation.status]):
            error = self._peer_exited(operation, gone) if gone else self._expire(operation)
            if error is not None:
                raise error
        error = self._check_received(operation)
        if error is not None:
            raise error
        return operation.status.Get_source() if operation.kind == "recv" else None

    def _track(self, operation: _Operation) -> P2PWork:
        work = P2PWork(operation.kind, operation.number, operation.buf.nbytes,
                       operation.buf if operation.kind == "recv" else None)
        work.keepalive = operation.buf  # MPI reads or writes it until the work completes
        operation.work = work
        with self._lock:
            self._pending.append(operation)
            if self._thread is None:
                self._thread = threading.Thread(target=self._progress_loop, daemon=True,
                                                name=f"commlib-p2p-{self.name}-r{self.rank}")
                self._thread.start()
            self._lock.notify()
        return work

    def _progress_loop(self) -> None:
        fine_timer_slack()  # this thread only waits: its short sleeps end on time (commlib/platform/timer_slack.py)
        polls, idle_since, sleep = 0, time.monotonic(), 1e-5
        next_give_up_check = idle_since + SLEEP_AFTER_SECONDS
        every = polls_per_yield()  # fixed since commlib.init counted the ranks on this machine
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._lock.wait()
                    polls, idle_since, sleep = 0, time.monotonic(), 1e-5
                if self._closed:
                    return
                operations = list(self._pending)
            now = time.monotonic()
            finished: List[Tuple[_Operation, Optional[BaseException]]] = []
            for operation in operations:
                try:
                    done = operation.request.Test(operation.status)
                except MPI.Exception as exc:  # a message larger than the buffer
                    finished.append((operation, self._mpi_error(operation, exc)))
                    continue
                if done:
                    finished.append((operation, self._check_received(operation)))
                elif now >= operation.deadline:
                    finished.append((operation, self._expire(operation)))
                elif now >= next_give_up_check:
                    gone = self._peers_gone(operation)
                    if gone:
                        finished.append((operation, self._peer_exited(operation, gone)))
            if now >= next_give_up_check:
                next_give_up_check = now + GIVE_UP_CHECK_SECONDS
            if finished:
                with self._lock:
                    for operation, _ in finished:
                        self._pending.remove(operation)
                for operation, error in finished:
                    if error is None and operation.kind == "recv":
                        operation.work.source = operation.status.Get_source()
                    operation.work.complete(error)
                polls, idle_since, sleep = 0, time.monotonic(), 1e-5
                continue
            polls += 1
            if polls % every == 0:
                os.sched_yield()
                idle = time.monotonic() - idle_since
                if idle > SLEEP_AFTER_SECONDS:
                    time.sleep(sleep)
                    sleep = next_sleep(sleep, idle, MAX_SLEEP_SECONDS)

    def _describe(self, operation: _Operation) -> str:
        peer = "any rank" if operation.peer == ANY_SOURCE else f"rank {operation.peer}"
        direction = "to" if operation.kind == "send" else "from"
        return (f"rank {self.rank}: {operation.kind} #{operation.number} of {format_bytes(operation.buf.nbytes)} "
                f"{direction} {peer} (tag {operation.tag}, group {self.name!r})")

    def _take_back(self, operation: _Operation):
        """Cancel the request: (True, error or None) if it completed after all, else (False, a note
        for the error message when MPI could not take a send back)."""
        request = operation.request
        try:
            request.Cancel()
        except MPI.Exception:
            pass
        grace = time.monotonic() + CANCEL_GRACE_SECONDS
        while not request.Test(operation.status):
            if time.monotonic() > grace:  # MPI could not take the send back: keep its buffer alive
                self._abandoned.append(operation)
                return False, (f"; MPI could not take the message back, so a receive rank "
                               f"{operation.peer} posts later with tag {operation.tag} will still get it")
        if not operation.status.Is_cancelled():
            return True, self._check_received(operation)
        return False, ""

    def _peers_gone(self, operation: _Operation) -> List[int]:
        """The peers whose exit means ``operation`` can never complete (on-node ones: the board)."""
        board = self.progress_board
        if board is None:
            return []
        gone = board.exited_peers()
        if operation.peer == ANY_SOURCE:
            return gone if len(gone) == self.size - 1 else []
        return [operation.peer] if operation.peer in gone else []

    def _peer_exited(self, operation: _Operation, gone: List[int]) -> Optional[BaseException]:
        completed, outcome = self._take_back(operation)
        if completed:
            return outcome
        waited = operation.timeout - max(0.0, operation.deadline - time.monotonic())
        matching = "receive" if operation.kind == "send" else "send"
        return PeerExitedError(f"{self._describe(operation)} cannot complete: rank{'s' if len(gone) > 1 else ''} "
                               f"{_ranks(gone)} exited without posting the matching {matching} (seen after "
                               f"{waited:.2g} s of the {operation.timeout:g} s timeout){outcome}")

    def _expire(self, operation: _Operation) -> Optional[BaseException]:
        """Cancel a request whose deadline passed; None if it completed after all."""
        completed, outcome = self._take_back(operation)
        if completed:
            return outcome
        still_out = outcome
        waiting = "receive" if operation.kind == "send" else "send"
        peer = "any rank" if operation.peer == ANY_SOURCE else f"rank {operation.peer}"
        return CommTimeoutError(f"{self._describe(operation)} timed out after {operation.timeout:g} s "
                                f"waiting for {peer} to post the matching {waiting}{still_out}")

    def _check_received(self, operation: _Operation) -> Optional[BaseException]:
        if operation.kind != "recv":
            return None
        count = operation.status.Get_count(MPI.BYTE)
        if count != operation.buf.nbytes:
            return CommError(f"{self._describe(operation)}: rank {operation.status.Get_source()} sent "
                             f"{format_bytes(count)}; expected {format_bytes(operation.buf.nbytes)} (the "
                             f"receive buffer's size)")
        return None

    def _mpi_error(self, operation: _Operation, exc) -> BaseException:
        if exc.Get_error_class() == MPI.ERR_TRUNCATE:
            return CommError(f"{self._describe(operation)}: the message does not fit the receive buffer "
                             f"of {format_bytes(operation.buf.nbytes)}: {exc}")
        return CommError(f"{self._describe(operation)} failed in MPI: {exc}")

    def _check_open(self) -> None:
        if self._closed:
            raise GroupAbortedError(f"group {self.name!r}: point-to-point used after the group was closed")

    def close(self) -> None:
        """Stop the progress thread, fail what is still pending, and free the communicator."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for operation in self._pending:
            _cancel_quietly([operation.request])
            operation.work.complete(GroupAbortedError(f"{self._describe(operation)}: the group was closed"))
        self._pending = []
        for operation in self._abandoned:
            try:
                operation.request.Free()
            except MPI.Exception:
                pass
        self._abandoned = []
        _free_quietly(self.comm)


def _dup_with_deadline(comm: MPI.Comm, timeout: float, name: str) -> MPI.Comm:
    dup, request = comm.Idup()
    if not wait_all([request], time.monotonic() + timeout):
        raise CommTimeoutError(
            f"rank {comm.Get_rank()}: group {name!r}: creating its point-to-point communicator timed "
            f"out after {timeout:g} s waiting for the other {comm.Get_size() - 1} rank(s) of the group")
    return dup


def _free_quietly(comm) -> None:
    if comm != MPI.COMM_NULL and not MPI.Is_finalized():
        try:
            comm.Free()
        except MPI.Exception:
            pass


def _cancel_quietly(requests) -> None:
    for request in requests:
        try:
            if not request.Test():
                request.Cancel()
                request.Test()
        except MPI.Exception:
            pass


def _ranks(ranks) -> str:
    return ", ".join(map(str, ranks))
