"""The handshake every commlib connection starts with: both ends prove the job secret.

Three fixed-size messages, HMAC-SHA256 over fresh nonces, before any other byte is read or
answered on the connection::

    server -> client  CHALLENGE  prefix | nonce_s                         (48 bytes)
    client -> server  RESPONSE   prefix | nonce_c | claim_c | mac_c       (112 bytes)
    server -> client  CONFIRM    prefix | claim_s | mac_s                 (80 bytes)
                  or  REFUSE     prefix (reason code) | zeros             (80 bytes)

    prefix  = magic "CLHS" | version | kind | purpose | claim length or reason | job id (8)
    mac_c   = HMAC(key, "client" | prefix_c | nonce_s | nonce_c | claim_c | binding)
    mac_s   = HMAC(key, "server" | prefix_s | nonce_c | nonce_s | claim_s | mac_c | binding)

Why it holds: the server's nonce is new for every connection, so a RESPONSE captured from a real
rank proves nothing on the next one (a replay fails its MAC); the client's nonce does the same for
the CONFIRM; the role names keep a message from being reflected back to its sender. ``purpose``
(store, transport, ...) keeps a handshake for one service from opening another. The *job id*
(:attr:`JobSecret.job_id`, one-way from the key) travels in clear so that "another job's secret"
can be told from "a forged or replayed handshake" in the errors. A *claim* (up to 32 bytes, e.g.
"rank 3 of group g") rides inside the MACs, so the other side learns who it talks to for sure.
``binding`` (not sent) ties the handshake to the channel under it: over TLS, the certificates'
fingerprints (a man in the middle holding its own certificate breaks the MACs).

The two ends are sans-IO state machines (:class:`ServerHandshake`, :class:`ClientHandshake`: bytes
in, bytes out), so an event loop can drive hundreds of half-open connections without a thread
each; :func:`authenticate` drives one over a blocking socket with a deadline. A refused
connection is logged once per source and reason (:class:`RefusalLog`), then closed. The
machines live in :mod:`.handshake_core`, which needs nothing but the standard library (a process
that cannot import commlib, like the crash witness, loads it by its path); here they raise
:class:`AuthenticationError`, a :class:`commlib.errors.CommError`.
"""

from __future__ import annotations

import socket
import time
from typing import Callable, Optional

from commlib.errors import CommError
from commlib.rendezvous import handshake_core as core
from commlib.rendezvous.handshake_core import (CHALLENGE_BYTES, CLAIM_BYTES, PURPOSES, REFUSALS, REPLY_BYTES,
                                               RESPONSE_BYTES, TIMED_OUT, CLOSED_EARLY, HandshakeRefused, RefusalLog,
                                               ServerConnection)
from commlib.rendezvous.secret import JobSecret

__all__ = ["AuthenticationError", "ServerHandshake", "ClientHandshake", "ServerConnection", "authenticate",
           "RefusalLog", "PURPOSES", "CHALLENGE_BYTES", "RESPONSE_BYTES", "REPLY_BYTES", "CLAIM_BYTES", "REFUSALS",
           "OPEN_SECRET", "secret_or_open"]

OPEN_SECRET = JobSecret(core.OPEN_KEY, "none (an open store)")


def secret_or_open(secret: Optional[JobSecret]) -> JobSecret:
    return OPEN_SECRET if secret is None else secret


class AuthenticationError(HandshakeRefused, CommError):
    """A connection did not prove the job secret (or refused ours). ``reason`` is a
    :data:`REFUSALS` code (0: other), ``peer`` where it came from or went to."""


class ServerHandshake(core.ServerHandshake):
    """The accepting end. Send :meth:`challenge`, read exactly :data:`RESPONSE_BYTES`, hand them
    to :meth:`respond`, send what it returns (CONFIRM, or REFUSE when it raised, in
    ``error.reply``), then the connection is authenticated and :attr:`peer_claim` says who it is."""

    refused = AuthenticationError

    def __init__(self, secret: JobSecret, purpose: str, claim: bytes = b"", binding: bytes = b"",
                 accept_claim: Optional[Callable[[bytes], Optional[str]]] = None):
        super().__init__(secret, purpose, claim, binding, accept_claim)


class ClientHandshake(core.ClientHandshake):
    """The connecting end. Read :data:`CHALLENGE_BYTES`, send what :meth:`answer` returns, read
    :data:`REPLY_BYTES`, hand them to :meth:`finish`: the server's claim, or AuthenticationError."""

    refused = AuthenticationError

    def __init__(self, secret: JobSecret, purpose: str, claim: bytes = b"", binding: bytes = b""):
        super().__init__(secret, purpose, claim, binding)


def _recv_exactly(sock: socket.socket, count: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < count:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AuthenticationError(REFUSALS[TIMED_OUT], TIMED_OUT)
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(count - len(data))
        except socket.timeout:
            raise AuthenticationError(REFUSALS[TIMED_OUT], TIMED_OUT) from None
        except OSError as error:
            raise AuthenticationError(f"{REFUSALS[CLOSED_EARLY]} ({error.strerror or error})", CLOSED_EARLY) from None
        if not chunk:
            break
        data += chunk
    return bytes(data)


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(max(deadline - time.monotonic(), 1e-3))
    try:
        sock.sendall(data)
    except socket.timeout:
        raise AuthenticationError(REFUSALS[TIMED_OUT], TIMED_OUT) from None
    except OSError as error:
        raise AuthenticationError(f"{REFUSALS[CLOSED_EARLY]} ({error.strerror or error})", CLOSED_EARLY) from None


def authenticate(sock: socket.socket, secret: Optional[JobSecret], role: str, timeout: float, *,
                 purpose: str, claim: bytes = b"", binding: bytes = b"",
                 accept_claim: Optional[Callable[[bytes], Optional[str]]] = None) -> bytes:
    """Run the handshake on a connected blocking ``sock`` as ``role`` ("client" or "server");
    return the peer's claim, or raise :class:`AuthenticationError` (the server sent its REFUSE
    first). ``secret`` None: the open key (see :data:`OPEN_SECRET`). Leaves ``sock`` blocking
    with no timeout."""
    deadline = time.monotonic() + timeout
    peer = _peer_name(sock)
    try:
        if role == "server":
            server = ServerHandshake(secret_or_open(secret), purpose, claim, binding, accept_claim)
            _send_all(sock, server.challenge(), deadline)
            response = _recv_exactly(sock, RESPONSE_BYTES, deadline)
            try:
                confirm = server.respond(response)
            except AuthenticationError as error:
                try:
                    _send_all(sock, error.reply, deadline)
                except AuthenticationError:
                    pass
                raise
            _send_all(sock, confirm, deadline)
            return server.peer_claim
        if role != "client":
            raise ValueError(f"role must be 'client' or 'server', got {role!r}")
        client = ClientHandshake(secret_or_open(secret), purpose, claim, binding)
        challenge = _recv_exactly(sock, CHALLENGE_BYTES, deadline)
        _send_all(sock, client.answer(challenge), deadline)
        return client.finish(_recv_exactly(sock, REPLY_BYTES, deadline))
    except AuthenticationError as error:
        error.peer = peer
        raise
    finally:
        sock.settimeout(None)


def _peer_name(sock: socket.socket) -> str:
    try:
        address = sock.getpeername()
    except OSError:
        return "an unknown peer"
    if not isinstance(address, tuple):
        return f"a local socket {address!r}" if address else "a local socket"
    host, port = address[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
