"""Building the socket transport's mesh: one authenticated connection per pair of ranks.

Every rank listens on the interface that reaches its peers (:func:`listen_addresses`: the one
named by ``COMMLIB_SOCKET_IFNAME``, else the one its store connection uses, else loopback when
all ranks share one host, else each of its addresses), publishes where through the rendezvous,
connects to every lower rank and accepts every higher one. All of it runs in one selector loop
of nonblocking sockets, each connection a small state machine (TCP connect, TLS, the job-secret
handshake of :mod:`commlib.rendezvous.handshake` with purpose "transport"), so a stranger that
connects and says nothing delays nobody: it is dropped at its handshake timeout, logged once, as
is anything that fails the handshake. The claims inside the handshake say which rank of which
group each end is (and its frame settings, which must agree), so a connection is known to come
from the rank it says. The listeners close as soon as the mesh is complete.
"""

from __future__ import annotations

import errno
import hashlib
import selectors
import socket
import ssl
import struct
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

from commlib.errors import CommError, CommTimeoutError
from commlib.platform.addresses import address_of_interface, interface_addresses
from commlib.rendezvous.handshake import (CHALLENGE_BYTES, REPLY_BYTES, RESPONSE_BYTES, AuthenticationError,
                                          ClientHandshake, RefusalLog, ServerHandshake, secret_or_open)
from commlib.rendezvous.interface import Rendezvous
from commlib.rendezvous.secret import JobSecret
from commlib.transports.socket.options import SocketOptions
from commlib.transports.socket.tls import TLSContexts, channel_binding, peer_fingerprint

__all__ = ["connect_mesh", "group_id", "listen_addresses", "Mesh"]

_CLAIM = struct.Struct("<II8sBxxxI")  # rank, size, group, flags, frame bytes
_CHECKS, _TLS = 1, 2
_MAX_HALF_OPEN = 64
_SIOCGIFADDR = 0x8915
_RETRY_SECONDS = 0.05


def group_id(name: str) -> bytes:
    """The 8 bytes that name a group in claims and frames."""
    return hashlib.sha256(b"commlib group " + name.encode()).digest()[:8]


def listen_addresses(options: SocketOptions, rendezvous: Rendezvous, hosts: Sequence[str]) -> List[str]:
    """Where this rank listens (see the module docstring), most likely first."""
    if options.interface:
        return [address_of_interface(options.interface)]
    reach = getattr(rendezvous, "reach_address", None)
    hint = reach() if callable(reach) else ""
    if hint:
        return [hint]
    if len(set(hosts)) == 1:
        return ["127.0.0.1"]
    found = interface_addresses()
    if not found:
        raise CommError(f"rank {rendezvous.rank}: host {hosts[rendezvous.rank]} has no address other hosts could "
                        f"reach (only loopback or link-local); set COMMLIB_SOCKET_IFNAME")
    return found


class Mesh:
    """The result: ``sockets[peer]`` (None at this rank), every rank's host name and endpoints."""

    def __init__(self, sockets: List[Optional[socket.socket]], hosts: List[str]):
        self.sockets = sockets
        self.hosts = hosts


def _claim(rank: int, size: int, group: bytes, options: SocketOptions) -> bytes:
    flags = (_CHECKS if options.frame_checks else 0) | (_TLS if options.tls else 0)
    return _CLAIM.pack(rank, size, group, flags, options.frame_bytes)


def _claim_problem(claim: bytes, expect_ranks: Sequence[int], size: int, group: bytes,
                   options: SocketOptions) -> Optional[str]:
    if len(claim) != _CLAIM.size:
        return f"a claim of {len(claim)} bytes"
    rank, their_size, their_group, flags, frame_bytes = _CLAIM.unpack(claim)
    mine = _claim(0, size, group, options)
    _, _, _, my_flags, my_frame_bytes = _CLAIM.unpack(mine)
    if their_group != group:
        return f"a rank of another group ({their_group.hex()}, this is {group.hex()})"
    if their_size != size:
        return f"rank {rank} of a group of {their_size}, this group has {size} ranks"
    if rank not in expect_ranks:
        return f"rank {rank}, which is not due to connect here (or is connected already)"
    if flags != my_flags or frame_bytes != my_frame_bytes:
        return (f"rank {rank} runs with frame checks {'on' if flags & _CHECKS else 'off'}, TLS "
                f"{'on' if flags & _TLS else 'off'}, frames of {frame_bytes} bytes; this rank with checks "
                f"{'on' if options.frame_checks else 'off'}, TLS {'on' if options.tls else 'off'}, frames of "
                f"{options.frame_bytes} bytes (COMMLIB_SOCKET_FRAME_CHECKS, COMMLIB_SOCKET_TLS and "
                f"COMMLIB_SOCKET_FRAME_BYTES must agree)")
    return None


class _Link:
    """One connection being set up, outgoing (to ``peer``) or incoming (``peer`` -1 until its claim)."""

    __slots__ = ("sock", "peer", "outgoing", "state", "inbuf", "need", "out", "handshake", "deadline", "source",
                 "want_write", "attempt", "refusal")

    def __init__(self, sock: socket.socket, peer: int, outgoing: bool, source: str, deadline: float):
        self.sock = sock
        self.peer = peer
        self.outgoing = outgoing
        self.state = "connect" if outgoing else "start"
        self.inbuf = bytearray()
        self.need = 0
        self.out = bytearray()
        self.handshake: Union[ClientHandshake, ServerHandshake, None] = None
        self.deadline = deadline
        self.source = source
        self.want_write = outgoing
        self.attempt = 0
        self.refusal = ""


class _MeshBuilder:
    def __init__(self, rendezvous: Rendezvous, secret: Optional[JobSecret], options: SocketOptions, group: bytes,
                 name: str, deadline: float):
        self.rank, self.size = rendezvous.rank, rendezvous.size
        self.secret = secret_or_open(secret)
        self.options = options
        self.group = group
        self.name = name
        self.deadline = deadline
        self.tls = TLSContexts(options.tls) if options.tls else None
        self.claim = _claim(self.rank, self.size, group, options)
        self.refusals = RefusalLog(f"rank {self.rank} socket transport (group {name!r})")
        self.refused: List[str] = []
        self.selector = selectors.DefaultSelector()
        self.done: Dict[int, socket.socket] = {}
        self.failures: Dict[int, List[str]] = {}  # outgoing peer -> what its attempts met
        self.dead_endpoints: Dict[int, set] = {}

    # -- the loop ----------------------------------------------------------------------------
    def run(self, listeners: List[socket.socket], endpoints: List[List[Tuple[str, int]]]) -> Dict[int, socket.socket]:
        self.endpoints = endpoints
        for listener in listeners:
            self.selector.register(listener, selectors.EVENT_READ, None)
        links: List[_Link] = []
        retry_at: Dict[int, float] = dict.fromkeys(range(self.rank), 0.0)
        expected = self.size - 1
        try:
            while len(self.done) < expected:
                now = time.monotonic()
                for peer, when in list(retry_at.items()):
                    if when <= now:
                        del retry_at[peer]
                        link = self._connect(peer)
                        if link is not None:
                            links.append(link)
                self._expire(links, retry_at, now)
                if len(self.done) >= expected:
                    break
                if now >= self.deadline:
                    raise self._timeout_error(links, retry_at)
                self._watch(links)
                wait = min([self.deadline - now, 0.5] + [when - now for when in retry_at.values()])
                for key, mask in self.selector.select(max(wait, 0.0)):
                    if key.data is None:
                        self._accept(key.fileobj, links)
                    else:
                        self._advance(key.data, mask, links, retry_at)
        finally:
            for link in links:
                self._forget(link)
                link.sock.close()
            for listener in listeners:
                try:
                    self.selector.unregister(listener)
                except (KeyError, ValueError):
                    pass
                listener.close()
            self.selector.close()
        return self.done

    def _watch(self, links: List[_Link]) -> None:
        for link in links:
            events = selectors.EVENT_WRITE if (link.want_write or link.out) else selectors.EVENT_READ
            try:
                key = self.selector.get_key(link.sock)
                if key.events != events:
                    self.selector.modify(link.sock, events, link)
            except KeyError:
                self.selector.register(link.sock, events, link)

    def _forget(self, link: _Link) -> None:
        try:
            self.selector.unregister(link.sock)
        except (KeyError, ValueError):
            pass

    # -- outgoing ----------------------------------------------------------------------------
    def _connect(self, peer: int) -> Optional[_Link]:
        dead = self.dead_endpoints.get(peer, set())
        candidates = [endpoint for endpoint in self.endpoints[peer] if endpoint not in dead]
        if not candidates:
            reasons = "; ".join(self.failures.get(peer, ["no address"]))
            raise AuthenticationError(f"rank {self.rank}: socket transport (group {self.name!r}): rank {peer} could "
                                      f"not be joined: {reasons}", 6, "")
        attempts = sum(1 for _ in self.failures.get(peer, ()))
        address, port = candidates[attempts % len(candidates)]
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        code = sock.connect_ex((address, port))
        link = _Link(sock, peer, True, _endpoint(address, port),
                     min(self.deadline, time.monotonic() + self.options.connect_attempt_timeout))
        if code not in (0, errno.EINPROGRESS):
            self._retry(link, None, f"{link.source}: {errno.errorcode.get(code, code)}")
            sock.close()
            return None
        return link

    def _retry(self, link: _Link, retry_at: Optional[Dict[int, float]], why: str, dead: bool = False) -> None:
        self.failures.setdefault(link.peer, []).append(why)
        if dead:
            address, port = link.source.rsplit(":", 1)
            self.dead_endpoints.setdefault(link.peer, set()).add((address.strip("[]"), int(port)))
        if retry_at is not None:
            retry_at[link.peer] = time.monotonic() + (0 if dead else _RETRY_SECONDS)

    # -- incoming ----------------------------------------------------------------------------
    def _accept(self, listener, links: List[_Link]) -> None:
        for _ in range(16):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            source = _endpoint(address[0], address[1])
            incoming = [link for link in links if not link.outgoing]
            if len(incoming) >= _MAX_HALF_OPEN:  # a rank authenticates in milliseconds: the oldest is idle
                oldest = incoming[0]
                why = f"{_MAX_HALF_OPEN} connections were authenticating at once; the oldest made room"
                self._drop(oldest, links)
                self.refusals.refuse(oldest.source, why)
                self.refused.append(f"{oldest.source} ({why})")
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(sock, -1, False, source, min(self.deadline,
                                                      time.monotonic() + self.options.handshake_timeout))
            links.append(link)
            self._begin(link)

    # -- both --------------------------------------------------------------------------------
    def _begin(self, link: _Link) -> None:
        """After TCP: TLS if configured, else the handshake."""
        if self.tls is not None:
            context = self.tls.client if link.outgoing else self.tls.server
            self._forget(link)  # the wrapped socket takes over the descriptor
            link.sock = context.wrap_socket(link.sock, server_side=not link.outgoing, do_handshake_on_connect=False)
            link.state = "tls"
            link.want_write = link.outgoing
            return
        self._start_handshake(link, b"")

    def _start_handshake(self, link: _Link, binding: bytes) -> None:
        link.state = "hello"
        link.want_write = False
        if link.outgoing:
            link.handshake = ClientHandshake(self.secret, "transport", self.claim, binding)
            link.need = CHALLENGE_BYTES
        else:
            expect = [peer for peer in range(self.rank + 1, self.size) if peer not in self.done]
            server = ServerHandshake(self.secret, "transport", self.claim, binding,
                                     lambda claim: _claim_problem(claim, expect, self.size, self.group, self.options))
            link.handshake = server
            link.out += server.challenge()
            link.need = RESPONSE_BYTES

    def _advance(self, link: _Link, mask: int, links: List[_Link], retry_at: Dict[int, float]) -> None:
        try:
            if link.state == "connect":
                code = link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if code:
                    raise _AttemptFailed(f"{link.source}: {errno.errorcode.get(code, code)}")
                link.deadline = min(self.deadline, time.monotonic() + self.options.handshake_timeout)
                self._begin(link)
            elif link.state == "tls":
                self._tls_step(link)
            elif link.state in ("hello", "closing"):
                self._hello_step(link, mask)
        except _AttemptFailed as failure:
            self._drop(link, links)
            if link.outgoing:
                self._retry(link, retry_at, str(failure), failure.dead)
            else:
                self.refusals.refuse(link.source, str(failure))
                self.refused.append(f"{link.source} ({failure})")
        if link.state == "done":
            links.remove(link)
            self._forget(link)
            if link.peer in self.done:  # two connections claimed one rank at once: keep the first
                self.refusals.refuse(link.source, f"rank {link.peer} is connected already")
                link.sock.close()
                return
            self.done[link.peer] = link.sock

    def _tls_step(self, link: _Link) -> None:
        sock = link.sock
        assert isinstance(sock, ssl.SSLSocket) and self.tls is not None
        try:
            sock.do_handshake()
        except ssl.SSLWantReadError:
            link.want_write = False
            return
        except ssl.SSLWantWriteError:
            link.want_write = True
            return
        except (ssl.SSLError, OSError) as error:
            raise _AttemptFailed(f"{link.source}: TLS failed ({getattr(error, 'reason', None) or error})",
                                 dead=True) from None
        theirs = peer_fingerprint(sock)
        binding = (channel_binding(theirs, self.tls.fingerprint) if link.outgoing
                   else channel_binding(self.tls.fingerprint, theirs))
        self._start_handshake(link, binding)

    def _hello_step(self, link: _Link, mask: int) -> None:
        sock = link.sock
        if link.out:
            try:
                sent = sock.send(link.out)
                del link.out[:sent]
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                return
            except OSError as error:
                raise _AttemptFailed(f"{link.source}: the connection failed ({error.strerror or error})") from None
            if link.out:
                return
            if link.state == "closing":
                raise _AttemptFailed(link.refusal)
            if not link.need:
                link.state = "done"
                return
        while len(link.inbuf) < link.need:
            try:
                chunk = sock.recv(link.need - len(link.inbuf))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError as error:
                chunk = b""
                if link.outgoing:
                    raise _AttemptFailed(f"{link.source}: the connection failed ({error.strerror or error})") from None
            if not chunk:
                raise _AttemptFailed(f"{link.source}: closed during the handshake" if link.outgoing
                                     else "it closed the connection during the handshake")
            link.inbuf += chunk
        data, link.inbuf, link.need = bytes(link.inbuf), bytearray(), 0
        handshake = link.handshake
        try:
            if isinstance(handshake, ClientHandshake):
                if len(data) == CHALLENGE_BYTES and handshake.mac == b"":
                    link.out += handshake.answer(data)
                    link.need = REPLY_BYTES
                else:
                    claim = handshake.finish(data)
                    problem = _claim_problem(claim, [link.peer], self.size, self.group, self.options)
                    if problem:
                        raise _AttemptFailed(f"{link.source}: the rank there is {problem}", dead=True)
                    link.state = "done"
                    return
            else:
                assert isinstance(handshake, ServerHandshake)
                link.out += handshake.respond(data)
                link.peer = _CLAIM.unpack(handshake.peer_claim)[0]
        except AuthenticationError as error:
            if link.outgoing:
                hint = (" (rank, group size, COMMLIB_SOCKET_FRAME_CHECKS, COMMLIB_SOCKET_TLS and "
                        "COMMLIB_SOCKET_FRAME_BYTES must agree; the peer's log says which differs)"
                        if error.reason == 6 else "")
                raise _AttemptFailed(f"{link.source}: {error}{hint}", dead=True) from None
            link.out += error.reply
            link.state = "closing"
            link.refusal = str(error)
        self._hello_step(link, mask)

    def _drop(self, link: _Link, links: List[_Link]) -> None:
        if link in links:
            links.remove(link)
        self._forget(link)
        link.sock.close()

    def _expire(self, links: List[_Link], retry_at: Dict[int, float], now: float) -> None:
        for link in [link for link in links if link.deadline <= now]:
            self._drop(link, links)
            if link.outgoing:
                connecting = link.state == "connect"
                limit = self.options.connect_attempt_timeout if connecting else self.options.handshake_timeout
                self._retry(link, retry_at, f"{link.source}: {'no answer' if connecting else 'no handshake'} "
                                            f"within {limit:g} s")
            else:
                why = f"no handshake within {self.options.handshake_timeout:g} s"
                self.refusals.refuse(link.source, why)
                self.refused.append(f"{link.source} ({why})")

    def _timeout_error(self, links: List[_Link], retry_at: Dict[int, float]) -> CommTimeoutError:
        missing = []
        for peer in range(self.size):
            if peer == self.rank or peer in self.done:
                continue
            if peer < self.rank:
                tried = self.failures.get(peer, [])
                shown = "; ".join(tried[-3:]) if tried else "the connection did not complete"
                missing.append(f"could not connect to rank {peer} ({shown})")
            else:
                missing.append(f"rank {peer} never connected")
        refused = f"; refused meanwhile: {', '.join(self.refused[-5:])}" if self.refused else ""
        return CommTimeoutError(f"rank {self.rank}: socket transport (group {self.name!r}, {self.size} ranks): the "
                                f"mesh was not complete in time: {'; '.join(missing)}{refused}")


class _AttemptFailed(Exception):
    def __init__(self, text: str, dead: bool = False):
        super().__init__(text)
        self.dead = dead


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _listen(address: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
    except OSError as error:
        listener.close()
        raise CommError(f"socket transport: cannot listen on {address}: {error.strerror}") from None
    listener.listen(128)
    listener.setblocking(False)
    return listener


def connect_mesh(rendezvous: Rendezvous, secret: Optional[JobSecret], options: SocketOptions, *, name: str,
                 timeout: float) -> Mesh:
    """Collective over ``rendezvous``: the authenticated connections of this rank to every other."""
    deadline = time.monotonic() + timeout
    rank, size = rendezvous.rank, rendezvous.size
    hosts = [str(host) for host in rendezvous.allgather(rendezvous.host_name())]
    if size == 1:
        return Mesh([None], hosts)
    group = group_id(name)
    addresses = listen_addresses(options, rendezvous, hosts) if rank < size - 1 else []  # the last only connects
    listeners = [_listen(address) for address in addresses]
    mine = [listener.getsockname()[:2] for listener in listeners]
    endpoints = [[(str(address), int(port)) for address, port in entry] for entry in rendezvous.allgather(mine)]
    builder = _MeshBuilder(rendezvous, secret, options, group, name, deadline)
    done = builder.run(listeners, endpoints)
    sockets: List[Optional[socket.socket]] = [done.get(peer) for peer in range(size)]
    for sock in sockets:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    return Mesh(sockets, hosts)
