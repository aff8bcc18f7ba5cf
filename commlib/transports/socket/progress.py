"""The progress engine: one ``epoll`` over every peer's connection, driven by the waiting thread.

No thread per peer, no thread at all: ``post`` writes what the sockets take at once (a small
send usually completes there), and ``wait`` reads and writes whatever is ready on *any*
connection until its own transfers are done, so transfers of earlier posts and of other peers
progress too, and a peer that leaves is seen at once whoever this rank waits for. Every
connection is always watched for its peer's close (``EPOLLRDHUP``) and, unless a frame is parked
on it, for input; for output only while a send is stuck.

A wait polls before it sleeps: for up to :data:`SPIN_SECONDS` it asks the epoll without a
timeout (handing the core over with ``sched_yield`` every few polls, after every one when the
job's ranks outnumber the machine's cores, as :mod:`commlib.platform.waiting` does for MPI),
and only then sleeps in it. A sleeping wait pays the scheduler's wake-up on each end of every
message: measured between two namespace hosts of this VM, an 8-byte exchange in Python took
39 us per round sleeping in the epoll at once and 6.3 us polling up to 20 us first (MPI, which
busy-polls, 8 us). Past the spin the engine sleeps as before, so a long wait costs no CPU.

Failures end the engine for good, and tell the peers (an ABORT frame naming the cause, then a
FIN) so that they raise at once instead of each waiting for its own timeout:

* :meth:`ProgressEngine.interrupt` from another thread (someone outside the collective knows
  it cannot finish: a peer cut off from the network sends no FIN): the error it gives, raised by
  the wait in progress at once (a wakeup descriptor in the epoll), or by the next post;

* a peer left while something posted needed it, or broke the group (aborted, or closed in the
  middle of a frame): :class:`commlib.errors.PeerExitedError` naming it (rank, host), or the
  :class:`commlib.errors.CommError` its ABORT explains;
* a frame that does not match the posted receive: :class:`commlib.errors.CollectiveMismatchError`
  (another collective or size) or :class:`commlib.errors.CommError` (a corrupt stream);
* the context's deadline: :class:`commlib.errors.CommTimeoutError` naming each transfer still
  incomplete (peer, host, step, bytes done of the total).
"""

from __future__ import annotations

import os
import select
import ssl
import threading
import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from commlib.errors import CollectiveMismatchError, CommError, CommTimeoutError, InvalidUsageError, PeerExitedError
from commlib.platform.machine import polls_per_yield
from commlib.transports.interface import CollectiveContext, Pending, Transfer
from commlib.transports.socket.connection import BadFrame, Connection, Departure, Incoming, Outgoing, PeerGone
from commlib.transports.socket.framing import ABORT_EXITED, ABORT_OTHER
from commlib.units import format_bytes

__all__ = ["ProgressEngine", "SocketPending", "byte_view"]

_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_CLOSED = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
_CONTROL_SECONDS = 1.0  # how long an ABORT or GOODBYE may take to write at the end
# How long a wait polls before it sleeps in the epoll (see the module docstring): well above a
# small message's round trip within a data centre (tens of microseconds), well below what a
# wait for a late peer or a large transfer lasts, so those still sleep almost all the time.
SPIN_SECONDS = 1e-3


def byte_view(buf, writable: bool) -> memoryview:
    """The bytes of a contiguous array, without a copy (bfloat16 included, through a uint8 view)."""
    try:
        view = memoryview(buf).cast("B")
    except (TypeError, ValueError):
        if not getattr(buf, "flags", None) or not buf.flags.c_contiguous:
            raise InvalidUsageError(f"socket transport: buffers must be C-contiguous arrays, got "
                                    f"{type(buf).__name__}") from None
        view = memoryview(np.asarray(buf).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    if writable and view.readonly:
        raise InvalidUsageError("socket transport: a receive into a read-only buffer")
    return view


class SocketPending(Pending):
    __slots__ = ("engine", "messages", "remaining")

    def __init__(self, engine: "ProgressEngine"):
        self.engine = engine
        self.messages: List = []
        self.remaining = 0  # messages not done yet (each message counts itself down)

    def wait(self) -> None:
        if self.remaining:
            self.engine.wait(self)


class ProgressEngine:
    """The transfers of one transport's ranks (``connections[peer]``, None at this rank)."""

    def __init__(self, rank: int, connections: Sequence[Optional[Connection]], context: CollectiveContext):
        self.rank = rank
        self.connections = list(connections)
        self.context = context
        self.failure: Optional[BaseException] = None
        self.closed = False
        self.epoll = select.epoll()
        self.by_fd: Dict[int, Connection] = {}
        for connection in self.connections:
            if connection is not None:
                connection.sock.setblocking(False)
                connection.interest = _IN | select.EPOLLRDHUP
                self.epoll.register(connection.fd, connection.interest)
                self.by_fd[connection.fd] = connection
        self.departed: List[Connection] = []
        # interrupt() writes it; the waiting thread, the only one that touches the connections,
        # then fails the engine itself.
        self.interrupted: Optional[Exception] = None
        self.wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.wake_lock = threading.Lock()  # interrupt() never writes a descriptor close() gave back
        self.epoll.register(self.wake_fd, _IN)
        # TLS may hold decrypted bytes that epoll cannot see (they left the socket already).
        self.tls_connections = [connection for connection in self.connections
                                if connection is not None and connection.tls]

    # -- posting -----------------------------------------------------------------------------
    def connection(self, peer: int, what: str) -> Connection:
        connection = self.connections[peer] if 0 <= peer < len(self.connections) else None
        if connection is None:
            raise InvalidUsageError(f"rank {self.rank}: {self.context.describe()}: {what} peer {peer} is not another "
                                    f"rank of a group of {len(self.connections)}")
        return connection

    def post(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> SocketPending:
        self.check_usable()
        if self.interrupted is not None:
            self._fail(self.interrupted)
        context = self.context
        seq, label = context.seq, context.step
        pending = SocketPending(self)
        # Checked before anything is queued: a usage error leaves no half-posted step behind.
        planned_recvs = [(self.connection(peer, "receive"), byte_view(buf, True)) for buf, peer in recvs]
        planned_sends = [(self.connection(peer, "send"), byte_view(buf, False)) for buf, peer in sends]
        pending.remaining = len(planned_recvs) + len(planned_sends)
        for connection, view in planned_recvs:
            message = Incoming(view, connection.peer, seq, connection.next_recv_step(seq), label, pending)
            connection.recv_queue.append(message)
            pending.messages.append(message)
            if connection.parked:
                connection.parked = False
                self.update_interest(connection)
        try:
            for connection, view in planned_sends:
                outgoing = Outgoing(view, connection.peer, seq, connection.next_send_step(seq), label, pending)
                pending.messages.append(outgoing)
                connection.queue_send(outgoing)
                if connection.send_queue:
                    self.update_interest(connection)
        except (PeerGone, BadFrame) as error:
            self._fail(error)
        return pending

    # -- waiting -----------------------------------------------------------------------------
    def wait(self, pending: SocketPending) -> None:
        self.check_usable()
        try:
            self._progress(pending)
        except (PeerGone, BadFrame) as error:
            self._fail(error)

    def resume_exchange(self, connection: Connection, send: Optional[memoryview], sent: int, recv: Optional[memoryview],
                        seq: int, send_step: int, recv_step: int, label: str) -> None:
        """Finish, as a posted exchange would, one that the fast path began with ``connection``'s
        peer (its message numbers ``send_step``/``recv_step`` of collective ``seq`` taken): the
        rest of the one-frame send ``send`` (``sent`` bytes of its frame written; None: it went
        out) and the receive into ``recv`` (None: it arrived). The context must have begun."""
        self.check_usable()
        if self.interrupted is not None:
            self._fail(self.interrupted)
        pending = SocketPending(self)
        try:
            if recv is not None:
                incoming = Incoming(recv, connection.peer, seq, recv_step, label, pending)
                pending.remaining += 1
                pending.messages.append(incoming)
                connection.recv_queue.append(incoming)
                connection.parked = False  # a parked header is read on as a posted receive's
            if send is not None:
                outgoing = Outgoing(send, connection.peer, seq, send_step, label, pending)
                pending.remaining += 1
                pending.messages.append(outgoing)
                connection.resume_send(outgoing, sent)
            self.update_interest(connection)
            if pending.remaining:
                self._progress(pending)
        except (PeerGone, BadFrame) as error:
            self._fail(error)

    def interrupt(self, error: Exception) -> None:
        """From any thread: end the engine with ``error`` (the first one given stays), raised by
        the wait in progress, or else by the next post or wait; the peers hear an ABORT naming it."""
        if self.interrupted is None:
            self.interrupted = error
        with self.wake_lock:
            if self.wake_fd >= 0:
                os.eventfd_write(self.wake_fd, 1)

    def _progress(self, pending: SocketPending) -> None:
        for message in pending.messages:  # before sleeping: what already arrived
            if not message.done and isinstance(message, Incoming):
                connection = self.connections[message.peer]
                assert connection is not None
                connection.pump_recv()
                self.update_interest(connection)
        deadline = self.context.deadline
        poll, by_fd = self.epoll.poll, self.by_fd
        monotonic, sched_yield = time.monotonic, os.sched_yield
        spin_until = monotonic() + SPIN_SECONDS
        polls, per_yield = 0, polls_per_yield()
        while pending.remaining:
            if self.interrupted is not None:
                self._fail(self.interrupted)
            for connection in self.departed:
                if connection.departure is not None and (connection.departure.urgent or connection.send_queue
                                                         or connection.recv_queue):
                    raise PeerGone(connection, connection.departure)
            now = monotonic()
            remaining = deadline - now
            if remaining <= 0:
                self._timed_out(pending)
            if self.tls_connections and self._pump_tls_buffers():
                continue
            if now < spin_until:
                timeout = 0.0
                polls += 1
                if polls % per_yield == 0:
                    sched_yield()
            else:
                timeout = min(remaining, 3600.0)
            for fd, events in poll(timeout):
                connection = by_fd.get(fd)
                if connection is None:  # the wake descriptor: the loop's next round sees interrupted
                    continue
                if events & _CLOSED:
                    self._unregister(connection)
                    connection.on_hangup()
                    continue
                if events & _IN:
                    connection.pump_recv()
                if events & _OUT:
                    connection.pump_send()
                self.update_interest(connection)

    def _pump_tls_buffers(self) -> bool:
        """Read what TLS decrypted already for posted receives; whether there was any."""
        found = False
        for connection in self.tls_connections:
            sock = connection.sock
            if connection.recv_queue and not connection.eof and isinstance(sock, ssl.SSLSocket) and sock.pending():
                found = True
                connection.pump_recv()
                self.update_interest(connection)
        return found

    def update_interest(self, connection: Connection) -> None:
        """Watch ``connection`` for what its state needs now (input unless a frame is parked,
        output while a send is stuck); after the fast path read a parked frame, too."""
        if connection.fd not in self.by_fd:
            return
        interest = select.EPOLLRDHUP | (0 if connection.parked else _IN) | (_OUT if connection.send_queue else 0)
        if interest != connection.interest:
            self.epoll.modify(connection.fd, interest)
            connection.interest = interest

    def _unregister(self, connection: Connection) -> None:
        if self.by_fd.pop(connection.fd, None) is not None:
            try:
                self.epoll.unregister(connection.fd)
            except (OSError, ValueError):
                pass
            self.departed.append(connection)

    # -- failing -----------------------------------------------------------------------------
    def check_usable(self) -> None:
        if self.failure is not None:
            raise CommError(f"rank {self.rank}: the socket transport failed earlier and cannot be used: "
                            f"{self.failure}")
        if self.closed:
            raise CommError(f"rank {self.rank}: the socket transport is closed")

    def _fail(self, cause: Exception) -> None:
        """Turn ``cause`` into the error this rank raises, tell the peers, and raise it."""
        if isinstance(cause, PeerGone):
            error, culprit, kind = self._departure_error(cause.connection, cause.departure)
        elif isinstance(cause, BadFrame):
            error_type = CollectiveMismatchError if cause.collective else CommError
            error = error_type(f"rank {self.rank}: {self.context.describe()}: {cause.text}"
                               + ("; the ranks called different collectives or sizes" if cause.collective else ""))
            culprit, kind = self.rank, ABORT_OTHER
        else:
            error, culprit, kind = cause, self.rank, ABORT_OTHER
        self.abort(error, culprit, kind)
        raise error

    def _departure_error(self, connection: Connection, departure: Departure):
        where = f"rank {self.rank}: {self.context.describe()} cannot complete"
        who = connection.describe()
        if departure.kind == "abort":
            if departure.abort_kind == ABORT_EXITED:
                gone = departure.culprit
                name = "this rank" if gone == self.rank else f"rank {gone} (host {self._host_of(gone)})"
                return (PeerExitedError(f"{where}: {name} exited; {who} saw it and aborted the group "
                                        f"({departure.text})"), gone, ABORT_EXITED)
            return (CommError(f"{where}: {who} aborted the group: {departure.text}"), departure.culprit, ABORT_OTHER)
        how = {"goodbye": f"closed the group after collective #{departure.last_seq}",
               "exited": "exited (its connection closed)",
               "cut": "closed its connection in the middle of a message (it exited or aborted)",
               "reset": "reset its connection (its process exited?)"}[departure.kind]
        return PeerExitedError(f"{where}: {who} {how}"), connection.peer, ABORT_EXITED

    def _host_of(self, rank: int) -> str:
        connection = self.connections[rank] if 0 <= rank < len(self.connections) else None
        return connection.host if connection is not None else "?"

    def _timed_out(self, pending: SocketPending) -> None:
        context = self.context
        waiting = []
        for message in pending.messages:
            if message.done:
                continue
            connection = self.connections[message.peer]
            assert connection is not None
            step = f" ({message.label})" if message.label else ""
            if isinstance(message, Incoming):
                waiting.append(f"recv of {format_bytes(message.total)} from {connection.describe()}{step}: "
                               f"{message.received} of {message.total} bytes arrived")
            else:
                done = message.offset - (sum(len(piece) for piece in message.pieces) if message.pieces else 0)
                waiting.append(f"send of {format_bytes(message.total)} to {connection.describe()}{step}: "
                               f"{max(done, 0)} of {message.total} bytes sent")
        error = CommTimeoutError(f"rank {self.rank}: {context.describe()} timed out after {context.timeout:g} s "
                                 f"waiting for {'; '.join(waiting) or 'completion'}")
        self._fail(error)

    def abort(self, error: BaseException, culprit: int, kind: int) -> None:
        """Give up for good: tell every peer still there why (ABORT), then close our side of each
        connection (a FIN after the ABORT; the sockets stay open until :meth:`close`)."""
        if self.failure is not None:
            return
        self.failure = error
        deadline = time.monotonic() + _CONTROL_SECONDS
        for connection in self.connections:
            if connection is None:
                continue
            if connection.departure is None or connection.departure.kind == "goodbye":
                connection.send_abort(culprit, kind, str(error), deadline)
            connection.shutdown_writes()
            self._unregister(connection)

    def close(self) -> None:
        """Say goodbye to every peer (naming the last collective), and close. Local; idempotent."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + _CONTROL_SECONDS
        for connection in self.connections:
            if connection is None:
                continue
            if self.failure is None and connection.departure is None:
                connection.send_goodbye(self.context.seq, deadline)
            connection.shutdown_writes()
            # After a failure, linger (bounded) so the peers read our ABORT before any reset.
            connection.close(deadline if self.failure is not None else 0.0)
        self.by_fd.clear()
        self.epoll.close()
        with self.wake_lock:
            os.close(self.wake_fd)
            self.wake_fd = -1
