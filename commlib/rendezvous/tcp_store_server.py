"""The TCP store's server: one thread, one selector, every connection a small state machine.

Run by rank 0 (:func:`commlib.rendezvous.tcp_store.open_tcp_store`) or standalone::

    COMMLIB_JOB_SECRET_FILE=~/.job-secret python -m commlib.rendezvous --host 10.0.0.1 --port 29500

A connection must complete the handshake (:mod:`.handshake`, purpose "store") within
``handshake_timeout`` before a byte of it is parsed as a request; one that fails is answered
with a REFUSE, logged (:class:`.handshake.RefusalLog`) and closed. What a connection may cost
is bounded: its input to one frame of at most ``max_value_bytes`` plus a little, its unsent
replies likewise (it is not read while they pile up), and the server holds at most
``max_connections`` connections and ``max_store_bytes`` of keys and values. A blocked ``get``
holds its connection, not a thread: it is answered when the keys are set, or with TIMEOUT at
its deadline, which the server keeps (so the client's connection stays in step). A key set with
``set_ephemeral`` lives as long as the connection that set it (ZooKeeper's ephemeral nodes): a
process that dies takes its key with it, which others see at once (the fault-tolerance
coordinator's liveness, :mod:`commlib.ft`).
"""

from __future__ import annotations

import heapq
import itertools
import selectors
import socket
import threading
import time
from typing import Dict, List, Optional, Set, Tuple

from commlib.errors import InvalidUsageError
from commlib.rendezvous.handshake import (RESPONSE_BYTES, AuthenticationError, RefusalLog, ServerHandshake,
                                          secret_or_open)
from commlib.rendezvous.secret import JobSecret
from commlib.rendezvous.store_protocol import (FRAME_OVERHEAD_BYTES, FrameReader, Op, ProtocolError, Status, decode,
                                               encode, pack_int, unpack_int)

__all__ = ["TCPStoreServer"]

_READ_BYTES = 256 << 10
_MAX_WAIT_SECONDS = 1e7


class _Connection:
    __slots__ = ("sock", "source", "handshake", "response", "reader", "out", "deadline", "blocked", "closing",
                 "interest", "ephemeral")

    def __init__(self, sock: socket.socket, source: str, handshake: ServerHandshake, deadline: float, max_body: int):
        self.sock = sock
        self.source = source
        self.handshake: Optional[ServerHandshake] = handshake  # None once authenticated
        self.response = bytearray()
        self.reader = FrameReader(max_body)
        self.out = bytearray()
        self.deadline = deadline
        # A request waiting for keys: (op, keys, want values, deadline).
        self.blocked: Optional[Tuple[int, List[bytes], bool, float]] = None
        self.closing = False  # close once ``out`` is flushed
        self.interest = 0
        self.ephemeral: Set[bytes] = set()  # keys that live as long as this connection


class TCPStoreServer:
    """The store's server on ``host:port`` (``port`` 0: any free one, see :attr:`port`).

    ``secret`` None: connections use the open key (see :data:`.handshake.OPEN_SECRET`): the
    store then trusts the network, as torch's ``TCPStore`` does; say so where it is used.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: Optional[JobSecret] = None, *,
                 handshake_timeout: float = 10.0, max_value_bytes: int = 64 << 20, max_connections: int = 1024,
                 max_store_bytes: int = 1 << 30, backlog: int = 512):
        self.host = host
        self.secret = secret_or_open(secret)
        self.handshake_timeout = handshake_timeout
        self.max_body = max_value_bytes + FRAME_OVERHEAD_BYTES
        self.max_connections = max_connections
        self.max_store_bytes = max_store_bytes
        self._listener = _bind(host, port, backlog)
        self.port: int = self._listener.getsockname()[1]
        self.refusals = RefusalLog(f"store server {self.describe()}")
        self._data: Dict[bytes, bytes] = {}
        self._stored_bytes = 0
        self._waiters: Dict[bytes, Set[_Connection]] = {}
        self._connections: Dict[int, _Connection] = {}
        self._timers: List[Tuple[float, int, _Connection]] = []
        self._tie = itertools.count()
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._closed = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def describe(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self._listener.getsockname()[1] if self._listener.fileno() >= 0 else '?'}"

    @property
    def connections(self) -> int:
        """How many connections the server holds now (authenticated or not)."""
        return len(self._connections)

    def start(self) -> "TCPStoreServer":
        """Serve on a daemon thread until :meth:`close`."""
        self._thread = threading.Thread(target=self.serve_forever, name=f"commlib-store-{self.port}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and close every connection. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:
            self._wake_write.send(b"x")
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        if self._thread is None:
            self._shutdown()

    # -- the loop ----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        try:
            while not self._closed.is_set():
                timeout = None
                if self._timers:
                    timeout = max(0.0, self._timers[0][0] - time.monotonic())
                for key, mask in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_read:
                        self._drain_wake()
                    else:
                        connection = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(connection)
                        if mask & selectors.EVENT_READ and connection.sock.fileno() >= 0:
                            self._read(connection)
                self._expire(time.monotonic())
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        for connection in list(self._connections.values()):
            self._drop(connection)
        for sock in (self._listener, self._wake_read, self._wake_write):
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self._selector.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_read.recv(64):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, aborted connection: try again on the next event
                return
            source = _source(address)
            if len(self._connections) >= self.max_connections:
                self.refusals.refuse(source, f"the server holds {self.max_connections} connections already")
                sock.close()
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            deadline = time.monotonic() + self.handshake_timeout
            connection = _Connection(sock, source, ServerHandshake(self.secret, "store"), deadline, self.max_body)
            self._connections[sock.fileno()] = connection
            connection.out += connection.handshake.challenge()  # type: ignore[union-attr]
            heapq.heappush(self._timers, (deadline, next(self._tie), connection))
            self._update_interest(connection)
            self._flush(connection)

    def _read(self, connection: _Connection) -> None:
        want = RESPONSE_BYTES - len(connection.response) if connection.handshake is not None else _READ_BYTES
        try:
            data = connection.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if connection.handshake is not None:
                self.refusals.refuse(connection.source, "it closed the connection during the handshake")
            self._drop(connection)
            return
        if connection.handshake is not None:
            connection.response += data
            if len(connection.response) == RESPONSE_BYTES:
                self._authenticate(connection)
            return
        try:
            connection.reader.feed(data)
        except ProtocolError as error:
            self.refusals.refuse(connection.source, f"a malformed request: {error}")
            self._drop(connection)
            return
        self._serve(connection)

    def _authenticate(self, connection: _Connection) -> None:
        handshake = connection.handshake
        assert handshake is not None
        try:
            connection.out += handshake.respond(bytes(connection.response))
        except AuthenticationError as error:
            self.refusals.refuse(connection.source, str(error))
            connection.out += error.reply
            connection.closing = True
            self._flush(connection)
            return
        connection.handshake = None
        connection.response = bytearray()
        self._flush(connection)

    def _serve(self, connection: _Connection) -> None:
        """Answer the connection's complete requests, in order, until one blocks."""
        try:
            while connection.blocked is None and not connection.closing and len(connection.out) <= self.max_body:
                body = connection.reader.next_body()
                if body is None:
                    break
                op, fields = decode(body)
                self._request(connection, op, fields)
        except ProtocolError as error:
            self.refusals.refuse(connection.source, f"a malformed request: {error}")
            self._drop(connection)
            return
        self._update_interest(connection)
        self._flush(connection)

    # -- the operations ----------------------------------------------------------------------
    def _request(self, connection: _Connection, op: int, fields: List[bytes]) -> None:
        data = self._data
        if op == Op.SET and len(fields) == 2:
            self._store(connection, fields[0], fields[1])
        elif op == Op.SET_EPHEMERAL and len(fields) == 2:
            if self._store(connection, fields[0], fields[1]):
                connection.ephemeral.add(fields[0])
        elif op in (Op.GET, Op.MULTI_GET) and len(fields) >= 2:
            seconds = min(max(unpack_int(fields[0]) / 1000.0, 0.0), _MAX_WAIT_SECONDS)
            keys = fields[1:]
            connection.blocked = (op, keys, True, time.monotonic() + seconds)
            if not self._answer_blocked(connection):
                for key in keys:
                    if key not in data:
                        self._waiters.setdefault(key, set()).add(connection)
                heapq.heappush(self._timers, (connection.blocked[3], next(self._tie), connection))
        elif op == Op.ADD and len(fields) == 2:
            current = data.get(fields[0], b"0")
            try:
                total = int(current) + unpack_int(fields[1])
            except ValueError:
                self._reply(connection, Status.ERROR, [b"the key holds %r, not an integer" % current[:32]])
                return
            if self._store(connection, fields[0], str(total).encode(), reply=False):
                self._reply(connection, Status.OK, [pack_int(total)])
        elif op == Op.COMPARE_SET and len(fields) == 3:
            key, expected, desired = fields
            existing = data.get(key)
            if (existing is None and not expected) or (existing is not None and existing == expected):
                if self._store(connection, key, desired, reply=False):
                    self._reply(connection, Status.OK, [desired])
            else:
                self._reply(connection, Status.OK, [expected if existing is None else existing])
        elif op == Op.CHECK:
            self._reply(connection, Status.OK, [b"\x01" if key in data else b"\x00" for key in fields])
        elif op == Op.DELETE and len(fields) == 1:
            value = data.pop(fields[0], None)
            if value is not None:
                self._stored_bytes -= len(fields[0]) + len(value)
            self._reply(connection, Status.OK, [b"\x01" if value is not None else b"\x00"])
        elif op == Op.NUM_KEYS and not fields:
            self._reply(connection, Status.OK, [pack_int(len(data))])
        elif op == Op.PING:
            self._reply(connection, Status.OK, [])
        else:
            raise ProtocolError(f"operation {Op.NAMES.get(op, op)} with {len(fields)} fields")

    def _store(self, connection: _Connection, key: bytes, value: bytes, reply: bool = True) -> bool:
        old = self._data.get(key)
        grown = len(key) + len(value) - (len(key) + len(old) if old is not None else 0)
        if self._stored_bytes + grown > self.max_store_bytes:
            self._reply(connection, Status.ERROR, [b"the store is full (%d bytes)" % self.max_store_bytes])
            return False
        self._data[key] = value
        self._stored_bytes += grown
        if reply:
            self._reply(connection, Status.OK, [])
        for waiter in self._waiters.pop(key, ()):
            if waiter.blocked is not None and self._answer_blocked(waiter):
                self._serve(waiter)
        return True

    def _answer_blocked(self, connection: _Connection) -> bool:
        """Answer the connection's blocked request if every key exists now."""
        assert connection.blocked is not None
        _, keys, _, _ = connection.blocked
        values = [self._data.get(key) for key in keys]
        if any(value is None for value in values):
            return False
        connection.blocked = None
        self._unwait(connection, keys)
        self._reply(connection, Status.OK, values)
        return True

    def _unwait(self, connection: _Connection, keys: List[bytes]) -> None:
        for key in keys:
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting.discard(connection)
                if not waiting:
                    del self._waiters[key]

    def _reply(self, connection: _Connection, status: int, fields) -> None:
        connection.out += encode(status, fields)

    def _expire(self, now: float) -> None:
        timers = self._timers
        while timers and timers[0][0] <= now:
            deadline, _, connection = heapq.heappop(timers)
            if connection.sock.fileno() < 0:
                continue
            if connection.handshake is not None and deadline == connection.deadline:
                self.refusals.refuse(connection.source, f"no handshake within {self.handshake_timeout:g} s")
                self._drop(connection)
            elif connection.blocked is not None and connection.blocked[3] == deadline:
                keys = connection.blocked[1]
                connection.blocked = None
                self._unwait(connection, keys)
                self._reply(connection, Status.TIMEOUT, [key for key in keys if key not in self._data])
                self._serve(connection)

    # -- sockets -----------------------------------------------------------------------------
    def _flush(self, connection: _Connection) -> None:
        if connection.out:
            try:
                sent = connection.sock.send(connection.out)
                del connection.out[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._drop(connection)
                return
        if connection.closing and not connection.out:
            self._drop(connection)
            return
        self._update_interest(connection)

    def _update_interest(self, connection: _Connection) -> None:
        if connection.sock.fileno() < 0:
            return
        # Not read while a request waits or replies pile up: input stays bounded by one frame.
        reading = connection.blocked is None and not connection.closing and len(connection.out) <= self.max_body
        interest = (selectors.EVENT_READ if reading else 0) | (selectors.EVENT_WRITE if connection.out else 0)
        if interest == connection.interest:
            return
        if connection.interest == 0:
            self._selector.register(connection.sock, interest, connection)
        elif interest == 0:
            self._selector.unregister(connection.sock)
        else:
            self._selector.modify(connection.sock, interest, connection)
        connection.interest = interest

    def _drop(self, connection: _Connection) -> None:
        sock = connection.sock
        if sock.fileno() < 0:
            return
        if connection.interest:
            self._selector.unregister(sock)
            connection.interest = 0
        self._connections.pop(sock.fileno(), None)
        if connection.blocked is not None:
            self._unwait(connection, connection.blocked[1])
            connection.blocked = None
        for key in connection.ephemeral:
            value = self._data.pop(key, None)
            if value is not None:
                self._stored_bytes -= len(key) + len(value)
        connection.ephemeral.clear()
        sock.close()


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise InvalidUsageError(f"store server: cannot resolve {host!r}: {error.strerror}") from None
    family, _, _, _, address = infos[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        why = ("the port is in use (another job, or a store of an earlier run?)" if port and error.errno == 98
               else f"{host} is not an address of this host" if error.errno == 99 else error.strerror)
        raise InvalidUsageError(f"store server: cannot listen on {host}:{port}: {why}") from None
    listener.listen(backlog)
    listener.setblocking(False)
    return listener


def _source(address) -> str:
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
