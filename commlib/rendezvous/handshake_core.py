"""The commlib handshake itself, in the standard library only: both ends prove the job secret.

:mod:`commlib.rendezvous.handshake` is what commlib's code uses (the same state machines,
raising :class:`commlib.rendezvous.handshake.AuthenticationError`); this module is what a process
that cannot import commlib loads by its path (the crash witness runs ``python -I -S``): it
imports nothing but the standard library. The protocol (see :mod:`commlib.rendezvous.handshake`
for why it holds)::

    server -> client  CHALLENGE  prefix | nonce_s                         (48 bytes)
    client -> server  RESPONSE   prefix | nonce_c | claim_c | mac_c       (112 bytes)
    server -> client  CONFIRM    prefix | claim_s | mac_s                 (80 bytes)
                  or  REFUSE     prefix (reason code) | zeros             (80 bytes)

    prefix  = magic "CLHS" | version | kind | purpose | claim length or reason | job id (8)
    mac_c   = HMAC(key, "client" | prefix_c | nonce_s | nonce_c | claim_c | binding)
    mac_s   = HMAC(key, "server" | prefix_s | nonce_c | nonce_s | claim_s | mac_c | binding)

A secret here is anything with ``key`` (32 bytes) and ``job_id``: a
:class:`commlib.rendezvous.secret.JobSecret`, or a :class:`Key`. :class:`ServerConnection` drives
the accepting end over a nonblocking socket for an event loop (bounded: it reads exactly the
RESPONSE, never more, and its owner enforces a deadline); :class:`RefusalLog` logs each refused
source once per reason.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import socket
import struct
import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, List, Optional, Tuple

__all__ = ["HandshakeRefused", "ServerHandshake", "ClientHandshake", "ServerConnection", "RefusalLog", "Key",
           "job_id_of", "PURPOSES", "REFUSALS", "CHALLENGE_BYTES", "RESPONSE_BYTES", "REPLY_BYTES", "CLAIM_BYTES",
           "OPEN_KEY", "OPEN_JOB_ID", "TIMED_OUT", "CLOSED_EARLY"]

MAGIC = b"CLHS"
VERSION = 1
_PREFIX = struct.Struct("<4sBBBB8s")  # magic, version, kind, purpose, claim length / reason, job id
NONCE_BYTES = CLAIM_BYTES = MAC_BYTES = 32
CHALLENGE_BYTES = _PREFIX.size + NONCE_BYTES
RESPONSE_BYTES = _PREFIX.size + NONCE_BYTES + CLAIM_BYTES + MAC_BYTES
REPLY_BYTES = _PREFIX.size + CLAIM_BYTES + MAC_BYTES  # CONFIRM and REFUSE alike
_CHALLENGE, _RESPONSE, _CONFIRM, _REFUSE = 1, 2, 3, 4

#: Services a handshake may open; a handshake for one does not open another.
PURPOSES = {"store": 1, "transport": 2, "witness": 3, "probe": 4}
_PURPOSE_NAMES = {code: name for name, code in PURPOSES.items()}

#: Why a handshake failed, by the code a REFUSE carries.
REFUSALS = {
    1: "not a commlib handshake",
    2: "another version of the commlib handshake",
    3: "another job's secret",
    4: "a wrong MAC (a forged or replayed handshake)",
    5: "a handshake for another service",
    6: "its claim was refused",
    7: "the handshake timed out",
    8: "the connection closed during the handshake",
}
_NOT_COMMLIB, _OTHER_VERSION, _OTHER_JOB, _BAD_MAC, _OTHER_PURPOSE, _CLAIM, _TIMEOUT, _CLOSED = range(1, 9)
#: The codes of the two refusals an end decides by itself (no message says them).
TIMED_OUT, CLOSED_EARLY = _TIMEOUT, _CLOSED

# Connections of a store or job started without a secret (see commlib.rendezvous.secret) still
# run the handshake, with this public key: it authenticates nothing, but a rank that has a
# secret and a server that has none (or the reverse) fail with a clear error, not garbage.
OPEN_KEY = hashlib.sha256(b"commlib: no job secret").digest()
_JOB_ID_LABEL = b"commlib job id v1"


def job_id_of(key: bytes) -> bytes:
    """The 8 bytes naming the job of ``key``, derived one way from it (safe to show and to send)."""
    return hmac.new(key, _JOB_ID_LABEL, hashlib.sha256).digest()[:8]


OPEN_JOB_ID = job_id_of(OPEN_KEY)


class Key:
    """A secret as the handshake needs it: ``key`` (32 bytes) and its ``job_id``."""

    def __init__(self, key: bytes):
        self.key = key
        self.job_id = job_id_of(key)


def _job_name(job_id: bytes) -> str:
    return "an open job (no secret)" if job_id == OPEN_JOB_ID else f"job {job_id.hex()}"


class HandshakeRefused(Exception):
    """A connection did not prove the job secret (or refused ours). ``reason`` is a
    :data:`REFUSALS` code (0: other), ``peer`` where it came from or went to."""

    def __init__(self, message: str, reason: int = 0, peer: str = ""):
        super().__init__(message)
        self.reason = reason
        self.peer = peer
        self.reply = b""  # what a server sends before closing: the REFUSE naming ``reason``


def _mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    digest = hmac.new(key, b"commlib handshake v1 " + role, hashlib.sha256)
    for part in parts:
        digest.update(part)
    return digest.digest()


def _padded_claim(claim: bytes) -> bytes:
    if len(claim) > CLAIM_BYTES:
        raise ValueError(f"a handshake claim is at most {CLAIM_BYTES} bytes, got {len(claim)}")
    return claim.ljust(CLAIM_BYTES, b"\0")


def _parse_prefix(data: bytes, kind: int, purpose: int, refused) -> Tuple[int, int, bytes]:
    """(kind, length-or-reason, job id) of a message, or ``refused`` (an exception type) with a REFUSALS code."""
    magic, version, got_kind, got_purpose, extra, job_id = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise refused(f"{REFUSALS[_NOT_COMMLIB]} (first bytes {bytes(data[:8])!r})", _NOT_COMMLIB)
    if version != VERSION:
        raise refused(f"{REFUSALS[_OTHER_VERSION]} (version {version}, this one speaks {VERSION})",
                                  _OTHER_VERSION)
    if got_kind not in (kind, _REFUSE):
        raise refused(f"{REFUSALS[_NOT_COMMLIB]} (message kind {got_kind} where {kind} was due)",
                                  _NOT_COMMLIB)
    if got_purpose != purpose:
        raise refused(f"{REFUSALS[_OTHER_PURPOSE]} ({_PURPOSE_NAMES.get(got_purpose, got_purpose)!s}, "
                                  f"not {_PURPOSE_NAMES[purpose]})", _OTHER_PURPOSE)
    return got_kind, extra, job_id


def _refusal(purpose: int, job_id: bytes, reason: int) -> bytes:
    return _PREFIX.pack(MAGIC, VERSION, _REFUSE, purpose, reason, job_id) + bytes(CLAIM_BYTES + MAC_BYTES)


class ServerHandshake:
    """The accepting end. Send :meth:`challenge`, read exactly :data:`RESPONSE_BYTES`, hand them
    to :meth:`respond`, send what it returns (CONFIRM, or REFUSE when it raised, in
    ``error.reply``), then the connection is authenticated and :attr:`peer_claim` says who it is."""

    refused = HandshakeRefused  # the exception type it raises

    def __init__(self, secret, purpose: str, claim: bytes = b"", binding: bytes = b"",
                 accept_claim: Optional[Callable[[bytes], Optional[str]]] = None):
        self.key = secret.key
        self.job_id = secret.job_id
        self.purpose = PURPOSES[purpose]
        self.claim = _padded_claim(claim)
        self.claim_length = len(claim)
        self.binding = binding
        self.accept_claim = accept_claim
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.peer_claim = b""

    def challenge(self) -> bytes:
        return _PREFIX.pack(MAGIC, VERSION, _CHALLENGE, self.purpose, 0, self.job_id) + self.nonce

    def respond(self, response: bytes) -> bytes:
        """The CONFIRM for a valid ``response``; else :attr:`refused` with ``.reply`` (REFUSE)."""
        try:
            if len(response) != RESPONSE_BYTES:
                raise self.refused(f"{REFUSALS[_CLOSED]} ({len(response)} of {RESPONSE_BYTES} bytes)", _CLOSED)
            kind, claim_length, job_id = _parse_prefix(response, _RESPONSE, self.purpose, self.refused)
            if kind != _RESPONSE:
                raise self.refused(f"{REFUSALS[_NOT_COMMLIB]} (a REFUSE where a RESPONSE was due)",
                                          _NOT_COMMLIB)
            if job_id != self.job_id:
                raise self.refused(f"{REFUSALS[_OTHER_JOB]} ({_job_name(job_id)}, this is "
                                          f"{_job_name(self.job_id)})", _OTHER_JOB)
            body = memoryview(response)[_PREFIX.size:]
            nonce_c, claim_c, mac_c = (bytes(body[:NONCE_BYTES]), bytes(body[NONCE_BYTES:NONCE_BYTES + CLAIM_BYTES]),
                                       bytes(body[NONCE_BYTES + CLAIM_BYTES:]))
            expected = _mac(self.key, b"client", bytes(response[:_PREFIX.size]), self.nonce, nonce_c, claim_c,
                            self.binding)
            if not hmac.compare_digest(expected, mac_c) or claim_length > CLAIM_BYTES:
                raise self.refused(REFUSALS[_BAD_MAC], _BAD_MAC)
            self.peer_claim = claim_c[:claim_length]
            if self.accept_claim is not None:
                why = self.accept_claim(self.peer_claim)
                if why:
                    raise self.refused(f"{REFUSALS[_CLAIM]}: {why}", _CLAIM)
        except self.refused as error:
            error.reply = _refusal(self.purpose, self.job_id, error.reason)
            raise
        prefix = _PREFIX.pack(MAGIC, VERSION, _CONFIRM, self.purpose, self.claim_length, self.job_id)
        return prefix + self.claim + _mac(self.key, b"server", prefix, nonce_c, self.nonce, self.claim, mac_c,
                                          self.binding)


class ClientHandshake:
    """The connecting end. Read :data:`CHALLENGE_BYTES`, send what :meth:`answer` returns, read
    :data:`REPLY_BYTES`, hand them to :meth:`finish`: the server's claim, or :attr:`refused`."""

    refused = HandshakeRefused  # the exception type it raises

    def __init__(self, secret, purpose: str, claim: bytes = b"", binding: bytes = b""):
        self.key = secret.key
        self.job_id = secret.job_id
        self.purpose = PURPOSES[purpose]
        self.claim = _padded_claim(claim)
        self.claim_length = len(claim)
        self.binding = binding
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.mac = b""
        self.server_job_id = b""

    def answer(self, challenge: bytes) -> bytes:
        if len(challenge) != CHALLENGE_BYTES:
            raise self.refused(f"{REFUSALS[_CLOSED]} ({len(challenge)} of {CHALLENGE_BYTES} bytes of the "
                                      f"challenge)", _CLOSED)
        kind, _, self.server_job_id = _parse_prefix(challenge, _CHALLENGE, self.purpose, self.refused)
        if kind != _CHALLENGE:
            raise self.refused(f"refused before the challenge: {REFUSALS.get(challenge[7], 'no reason')}",
                                      challenge[7])
        # Answered even for another job: the server then logs who knocked, and both sides say why.
        prefix = _PREFIX.pack(MAGIC, VERSION, _RESPONSE, self.purpose, self.claim_length, self.job_id)
        self.mac = _mac(self.key, b"client", prefix, bytes(challenge[_PREFIX.size:]), self.nonce, self.claim,
                        self.binding)
        self.server_nonce = bytes(challenge[_PREFIX.size:])
        return prefix + self.nonce + self.claim + self.mac

    def finish(self, reply: bytes) -> bytes:
        if len(reply) != REPLY_BYTES:
            raise self.refused(f"{REFUSALS[_CLOSED]} ({len(reply)} of {REPLY_BYTES} bytes of the reply)",
                                      _CLOSED)
        kind, extra, job_id = _parse_prefix(reply, _CONFIRM, self.purpose, self.refused)
        if kind == _REFUSE:
            why = REFUSALS.get(extra, f"reason {extra}")
            if extra == _OTHER_JOB or self.server_job_id != self.job_id:
                why = (f"{REFUSALS[_OTHER_JOB]} (it is {_job_name(self.server_job_id)}, this rank "
                       f"{_job_name(self.job_id)})")
            raise self.refused(f"refused: {why}", extra)
        body = memoryview(reply)[_PREFIX.size:]
        claim_s, mac_s = bytes(body[:CLAIM_BYTES]), bytes(body[CLAIM_BYTES:])
        expected = _mac(self.key, b"server", bytes(reply[:_PREFIX.size]), self.nonce, self.server_nonce, claim_s,
                        self.mac, self.binding)
        if job_id != self.job_id or not hmac.compare_digest(expected, mac_s) or extra > CLAIM_BYTES:
            raise self.refused(f"the server's confirmation has {REFUSALS[_BAD_MAC]}", _BAD_MAC)
        return claim_s[:extra]


class ServerConnection:
    """The accepting end of one nonblocking connection, until it is authenticated or refused.

    :meth:`step` does what the socket allows now: sends the CHALLENGE, reads exactly
    :data:`RESPONSE_BYTES` (never a byte more: what follows belongs to the service), sends the
    CONFIRM or the REFUSE. ``state`` is then "hello" (more to do; :attr:`wants_write` says for
    which event to wait), "open" (authenticated: :attr:`peer_claim` is the client's claim) or
    "refused" (close it; :attr:`refusal` says why). The owner closes connections past their
    deadline (:data:`REFUSALS` code 7).
    """

    def __init__(self, sock: socket.socket, source: str, handshake: ServerHandshake, deadline: float):
        self.sock, self.source, self.handshake, self.deadline = sock, source, handshake, deadline
        self.out = bytearray(handshake.challenge())
        self.inbuf = bytearray()
        self.state = "hello"
        self.after = "hello"  # what the state becomes once ``out`` is written
        self.refusal = ""
        self.peer_claim = b""

    @property
    def wants_write(self) -> bool:
        return bool(self.out)

    def step(self) -> str:
        while self.state == "hello":
            if self.out:
                try:
                    sent = self.sock.send(self.out)
                except (BlockingIOError, InterruptedError):
                    return self.state
                except OSError as error:
                    return self._refuse(self.refusal or f"{REFUSALS[_CLOSED]} ({error.strerror or error})")
                del self.out[:sent]
                if self.out:
                    return self.state
                if self.after != "hello":
                    self.state = self.after
                    return self.state
            try:
                chunk = self.sock.recv(RESPONSE_BYTES - len(self.inbuf))
            except (BlockingIOError, InterruptedError):
                return self.state
            except OSError as error:
                return self._refuse(f"{REFUSALS[_CLOSED]} ({error.strerror or error})")
            if not chunk:
                return self._refuse(f"{REFUSALS[_CLOSED]} ({len(self.inbuf)} of {RESPONSE_BYTES} bytes)")
            self.inbuf += chunk
            if len(self.inbuf) < RESPONSE_BYTES:
                continue
            try:
                self.out += self.handshake.respond(bytes(self.inbuf))
                self.peer_claim = self.handshake.peer_claim
                self.after = "open"
            except HandshakeRefused as error:
                self.out += error.reply
                self.after = "refused"
                self.refusal = str(error)
        return self.state

    def _refuse(self, why: str) -> str:
        self.state, self.refusal = "refused", why
        return self.state


class RefusalLog:
    """Where refused connections are logged (logger ``commlib.auth``): the first refusal of each
    (source host, kind of reason) at once, with its details; repeats counted and summarised at
    most every ``quiet`` seconds, so a flood of strangers costs a bounded table and a few lines,
    not a line each. The kind is the reason without its details ("not a commlib handshake (first
    bytes ...)" is "not a commlib handshake"): random bytes from one host are one stranger."""

    def __init__(self, service: str, *, quiet: float = 10.0, max_sources: int = 256,
                 logger: Optional[logging.Logger] = None):
        self.service = service
        self.quiet = quiet
        self.max_sources = max_sources
        self.logger = logger or logging.getLogger("commlib.auth")
        self._lock = threading.Lock()
        self._seen: Dict[Tuple[str, str], list] = {}  # (host, kind) -> [repeats, last summary time]
        self._recent: Deque[str] = deque(maxlen=4)  # for errors: a peer that never came may have been refused
        self.refused = 0

    def recent(self) -> List[str]:
        """The last few refusals (``source: why``), newest last."""
        with self._lock:
            return list(self._recent)

    def refuse(self, source: str, why: str) -> None:
        host = source.rsplit(":", 1)[0] if ":" in source else source  # "host:port" or "[v6]:port"
        kind = why.split(" (", 1)[0].split(": ", 1)[0]
        now = time.monotonic()
        with self._lock:
            self.refused += 1
            self._recent.append(f"{source}: {why}")
            entry = self._seen.get((host, kind))
            if entry is None:
                if len(self._seen) >= self.max_sources:
                    overflow = self._seen.get(("(other sources)", ""))
                    if overflow is not None:
                        overflow[0] += 1
                        return
                    self._seen[("(other sources)", "")] = [0, now]
                    message = (f"{self.service}: refused a connection from {source}: {why}; refusals from more "
                               f"than {self.max_sources} sources or reasons are counted from here, not named")
                else:
                    self._seen[(host, kind)] = [0, now]
                    message = f"{self.service}: refused a connection from {source}: {why}"
            else:
                entry[0] += 1
                if now - entry[1] < self.quiet:
                    return
                message = f"{self.service}: refused {entry[0]} more connections from {host}: {kind}"
                entry[0], entry[1] = 0, now
        self.logger.warning(message)
