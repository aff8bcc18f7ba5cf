"""The TCP store's client (:class:`TCPStore`), and :func:`open_tcp_store`, what rank 0 and the
others call to meet at ``host:port`` (rank 0 starts the server there).

One connection per client, authenticated before anything else (purpose "store"), one request
at a time (a lock: threads may share a client). A blocking ``get`` waits on the server, which
answers TIMEOUT at the deadline, so the connection stays in step; the client gives the server
a grace period on top, and a server that does not answer even then (hung, or the network
gone) makes the client fail and drop the connection.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import List, Optional, Sequence, Tuple

from commlib.errors import CommError, CommTimeoutError, InvalidUsageError
from commlib.rendezvous.handshake import AuthenticationError, authenticate
from commlib.rendezvous.secret import JobSecret
from commlib.rendezvous.store import Store, Value, as_value, check_key
from commlib.rendezvous.store_protocol import (FRAME_OVERHEAD_BYTES, Op, ProtocolError, Status, decode, encode,
                                               pack_int, unpack_int)
from commlib.rendezvous.tcp_store_server import TCPStoreServer

__all__ = ["TCPStore", "open_tcp_store"]

_LENGTH = struct.Struct("<I")
_REPLY_GRACE_SECONDS = 30.0


class TCPStore(Store):
    """A client of the TCP store at ``host:port``.

    Connecting retries (the server may start a little later) until ``connect_timeout`` (default:
    ``timeout``). ``secret`` must be the server's (None: an open store, see
    :class:`.tcp_store_server.TCPStoreServer`). ``server``: a server this client owns and closes.
    """

    def __init__(self, host: str, port: int, secret: Optional[JobSecret] = None, *, timeout: float = 300.0,
                 connect_timeout: Optional[float] = None, handshake_timeout: float = 10.0,
                 max_value_bytes: int = 64 << 20, server: Optional[TCPStoreServer] = None):
        self.host, self.port = host, int(port)
        self.timeout = self.resolve_timeout(timeout)
        self.max_value_bytes = max_value_bytes
        self._max_body = max_value_bytes + FRAME_OVERHEAD_BYTES
        self._server = server
        self._lock = threading.Lock()
        self._sock: Optional[socket.socket] = None
        try:
            self._sock = self._connect(secret, self.timeout if connect_timeout is None else connect_timeout,
                                       handshake_timeout)
        except BaseException:
            if server is not None:
                server.close()
            raise

    def recent_refusals(self) -> List[str]:
        """What the server this client owns refused lately (``source: why``); none without one."""
        return self._server.refusals.recent() if self._server is not None else []

    def describe(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def _connect(self, secret, connect_timeout: float, handshake_timeout: float) -> socket.socket:
        deadline = time.monotonic() + connect_timeout
        pause = 0.01
        while True:
            remaining = deadline - time.monotonic()
            try:
                sock = socket.create_connection((self.host, self.port), timeout=max(remaining, 0.05))
                break
            except (ConnectionRefusedError, socket.timeout, OSError) as error:
                if remaining <= 0:
                    why = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
                    raise CommTimeoutError(f"store {self.describe()}: no server answered within {connect_timeout:g} s "
                                           f"(last attempt: {why}); is MASTER_ADDR/MASTER_PORT right, and rank 0 "
                                           f"started?") from None
                time.sleep(min(pause, max(remaining, 0)))
                pause = min(pause * 2, 0.25)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            authenticate(sock, secret, "client", handshake_timeout, purpose="store")
        except AuthenticationError as error:
            sock.close()
            raise AuthenticationError(f"store {self.describe()}: {error} (COMMLIB_JOB_SECRET must be the "
                                      f"server's)", error.reason, error.peer) from None
        except BaseException:
            sock.close()
            raise
        return sock

    def local_address(self) -> str:
        """The address of this host's interface that reaches the store (what peers can likely reach)."""
        sock = self._sock
        return sock.getsockname()[0] if sock is not None else ""

    # -- requests ----------------------------------------------------------------------------
    def _call(self, op: int, fields: Sequence[bytes], wait: float = 0.0) -> Tuple[int, List[bytes]]:
        request = encode(op, fields)
        if len(request) > self._max_body:
            raise InvalidUsageError(f"store {self.describe()}: a {Op.NAMES[op]} of {len(request)} bytes; the store "
                                    f"takes values of at most {self.max_value_bytes} bytes "
                                    f"(COMMLIB_STORE_MAX_VALUE_BYTES)")
        with self._lock:
            sock = self._sock
            if sock is None:
                raise CommError(f"store {self.describe()}: the connection is closed")
            try:
                sock.settimeout(wait + _REPLY_GRACE_SECONDS)
                sock.sendall(request)
                (length,) = _LENGTH.unpack(self._read_exactly(sock, _LENGTH.size))
                if length > self._max_body:
                    raise ProtocolError(f"a reply of {length} bytes, more than the {self._max_body} allowed")
                status, reply = decode(self._read_exactly(sock, length))
            except socket.timeout:
                self._drop()
                raise CommTimeoutError(f"store {self.describe()}: no reply to {Op.NAMES[op]} within "
                                       f"{wait + _REPLY_GRACE_SECONDS:g} s; the connection is dropped") from None
            except (OSError, ProtocolError) as error:
                self._drop()
                raise CommError(f"store {self.describe()}: {Op.NAMES[op]} failed, the connection is lost "
                                f"({error}); did the server (rank 0) exit?") from None
        if status == Status.ERROR:
            raise CommError(f"store {self.describe()}: {Op.NAMES[op]} refused: "
                            f"{reply[0].decode(errors='replace') if reply else 'no reason'}")
        return status, reply

    def _read_exactly(self, sock: socket.socket, count: int) -> bytes:
        data = bytearray(count)
        view = memoryview(data)
        position = 0
        while position < count:
            got = sock.recv_into(view[position:])
            if not got:
                raise ConnectionResetError(0, "the server closed the connection")
            position += got
        return bytes(data)

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- the operations ----------------------------------------------------------------------
    def set(self, key: str, value: Value) -> None:
        self._call(Op.SET, [check_key(key), as_value(value)])

    def set_ephemeral(self, key: str, value: Value) -> None:
        """Set ``key`` for as long as this client's connection lives: the server deletes it when the
        connection closes (this process exited, or :meth:`close`). Ours only: torch's stores have none."""
        self._call(Op.SET_EPHEMERAL, [check_key(key), as_value(value)])

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        return self._blocking(Op.GET, [key], timeout, "get")[0]

    def multi_get(self, keys: Sequence[str], timeout: Optional[float] = None) -> List[bytes]:
        if not keys:
            return []
        return self._blocking(Op.MULTI_GET, list(keys), timeout, f"multi_get of {len(keys)} keys")

    def _blocking(self, op: int, keys: List[str], timeout: Optional[float], what: str) -> List[bytes]:
        seconds = self.resolve_timeout(timeout)
        status, reply = self._call(op, [pack_int(int(seconds * 1000))] + [check_key(key) for key in keys], seconds)
        if status == Status.TIMEOUT:
            raise self.timeout_error(what, [field.decode(errors="replace") for field in reply], seconds)
        if len(reply) != len(keys):
            raise CommError(f"store {self.describe()}: {what}: {len(reply)} values for {len(keys)} keys")
        return reply

    def add(self, key: str, amount: int) -> int:
        return unpack_int(self._call(Op.ADD, [check_key(key), pack_int(int(amount))])[1][0])

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        return self._call(Op.COMPARE_SET, [check_key(key), as_value(expected), as_value(desired)])[1][0]

    def check(self, keys: Sequence[str]) -> bool:
        return not self.missing(keys)

    def missing(self, keys: Sequence[str]) -> List[str]:
        if not keys:
            return []
        flags = self._call(Op.CHECK, [check_key(key) for key in keys])[1]
        return [key for key, flag in zip(keys, flags) if flag != b"\x01"]

    def delete_key(self, key: str) -> bool:
        return self._call(Op.DELETE, [check_key(key)])[1][0] == b"\x01"

    def num_keys(self) -> int:
        return unpack_int(self._call(Op.NUM_KEYS, [])[1][0])

    def ping(self) -> None:
        self._call(Op.PING, [])

    def close(self) -> None:
        with self._lock:
            self._drop()
        if self._server is not None:
            self._server.close()
            self._server = None


def open_tcp_store(host: str, port: int, secret: Optional[JobSecret], *, is_server: bool, timeout: float = 300.0,
                   handshake_timeout: float = 10.0, max_value_bytes: int = 64 << 20) -> TCPStore:
    """The store at ``host:port``: rank 0 (``is_server``) starts the server there (bound to
    ``host``, which must be an address of its host: it listens on that interface only), and
    every rank connects to it. Closing rank 0's client stops the server."""
    server = None
    if is_server:
        server = TCPStoreServer(host, port, secret, handshake_timeout=handshake_timeout,
                                max_value_bytes=max_value_bytes).start()
        port = server.port
    return TCPStore(host, port, secret, timeout=timeout, handshake_timeout=handshake_timeout,
                    max_value_bytes=max_value_bytes, server=server)
