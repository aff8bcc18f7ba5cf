"""An address of rank 0's host that every rank can reach, found without DNS.

A TCP rendezvous (torch's ``TCPStore``) needs an address of rank 0. The host name often does not
resolve on the other hosts (nor on its own: many clusters have no DNS entry for their nodes), so
rank 0 lists its own interface addresses (or the one ``interface`` names), listens on each of
them - not on every interface - with a *probe*, sends the endpoints over MPI with a random
token, and every other rank tries them in turn: the first endpoint whose probe proves the job
secret (the handshake of :mod:`.handshake`, purpose "probe", the token as the probe's claim)
wins. The handshake comes before anything else on a connection, so a stranger learns nothing
and a different listener on the same port (an address that exists on every host, like a
container bridge's) cannot pass for the probe. Strangers are logged once per source and reason;
half-open connections are bounded (the oldest makes room: a rank authenticates in milliseconds)
and closed at the handshake timeout; the listeners close as soon as every rank has reported.
When a rank reaches none, every rank raises the same error naming, per failed rank, each
endpoint tried and what happened.
"""

from __future__ import annotations

import secrets
import selectors
import socket
import threading
import time
from typing import List, Optional, Tuple

from commlib.errors import CommError
from commlib.platform.addresses import address_of_interface, interface_addresses
from commlib.rendezvous.handshake import (AuthenticationError, RefusalLog, ServerConnection, ServerHandshake,
                                          authenticate)
from commlib.rendezvous.mpi import MPIRendezvous
from commlib.rendezvous.secret import JobSecret, share_secret

__all__ = ["reachable_root_address", "ProbeListener", "first_reachable"]

MAX_HALF_OPEN = 64
_TOKEN_BYTES = 16


def reachable_root_address(comm, connect_timeout: float = 5.0, *, secret: Optional[JobSecret] = None,
                           interface: Optional[str] = None, handshake_timeout: float = 10.0) -> str:
    """Collective over ``comm``: the address this rank should use to reach rank 0's host.

    Rank 0 gets ``127.0.0.1``; so does everyone when all ranks share one host. ``secret``: the
    job's (None: one made for this probe by rank 0 and handed over ``comm``, which nothing
    outside the job can join); ``interface``: the only one rank 0 offers and listens on (a name
    or an address, as ``COMMLIB_SOCKET_IFNAME``).
    """
    from mpi4py import MPI

    hosts = comm.allgather(MPI.Get_processor_name())
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    if secret is None:
        secret = share_secret(MPIRendezvous(comm), None)
    rank = comm.Get_rank()
    probe: Optional[ProbeListener] = None
    offer: Optional[Tuple[List[Tuple[str, int]], bytes]] = None
    try:
        if rank == 0:
            candidates = [address_of_interface(interface)] if interface else interface_addresses()
            if candidates:
                probe = ProbeListener(secret, candidates, handshake_timeout, service=f"rank 0 address probe on "
                                                                                    f"{hosts[0]}")
                offer = (probe.endpoints, probe.token)
        offer = comm.bcast(offer, root=0)
        if offer is None:
            raise CommError(f"rank {rank}: rank 0 (host {hosts[0]}) has no network address other ranks "
                            f"could reach (only loopback or link-local); set MASTER_ADDR and MASTER_PORT")
        endpoints, token = offer
        chosen, attempts = (("127.0.0.1", []) if rank == 0 else
                            first_reachable(endpoints, token, secret, connect_timeout))
        reports = comm.gather((chosen, attempts), root=0)
    finally:
        if probe is not None:
            probe.close()
    failures = None
    if rank == 0:
        failures = [f"rank {peer} on host {hosts[peer]} tried "
                    + ", ".join(f"{endpoint} ({why})" for endpoint, why in tried)
                    for peer, (address, tried) in enumerate(reports) if address is None]
    failures = comm.bcast(failures, root=0)
    if failures:
        raise CommError(f"rank {rank}: no address of rank 0's host {hosts[0]} was reachable from every "
                        f"rank: {'; '.join(failures)}. Set MASTER_ADDR (and MASTER_PORT) to an address of "
                        f"rank 0's host that every host can reach")
    assert chosen is not None  # a rank that reached none is in failures, and every rank raised
    return chosen


def first_reachable(endpoints, token: bytes, secret: JobSecret, connect_timeout: float
                    ) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    """The address of the first of ``endpoints`` (address, port) whose probe proves ``secret``
    and ``token``; the attempts before it (endpoint, what happened)."""
    attempts: List[Tuple[str, str]] = []
    for address, port in endpoints:
        where = f"{_bracketed(address)}:{port}"
        try:
            with socket.create_connection((address, port), timeout=connect_timeout) as connection:
                claim = authenticate(connection, secret, "client", connect_timeout, purpose="probe")
            if claim == token:
                return address, attempts
            attempts.append((where, "the probe of another job answered (another token)"))
        except AuthenticationError as error:
            attempts.append((where, f"no commlib probe of this job there: {error}"))
        except socket.timeout:
            attempts.append((where, f"no answer within {connect_timeout:g} s"))
        except OSError as error:
            attempts.append((where, error.strerror or type(error).__name__))
    return None, attempts


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class ProbeListener:
    """Rank 0's probe: listens on each of ``addresses`` and authenticates every connection
    (purpose "probe", ``token`` as its claim), on a thread of its own, until :meth:`close`.
    ``endpoints`` are where it listens."""

    def __init__(self, secret: JobSecret, addresses: List[str], handshake_timeout: float = 10.0, *,
                 service: str = "address probe", token: Optional[bytes] = None):
        self.secret, self.handshake_timeout = secret, handshake_timeout
        self.token = token or secrets.token_bytes(_TOKEN_BYTES)
        self.refusals = RefusalLog(service)
        self.selector = selectors.DefaultSelector()
        self.listeners: List[socket.socket] = []
        try:
            for address in addresses:
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                listener = socket.create_server((address, 0), family=family, backlog=128)
                listener.setblocking(False)
                self.listeners.append(listener)
                self.selector.register(listener, selectors.EVENT_READ, None)
        except OSError as error:
            self._close_sockets()
            raise CommError(f"address probe: cannot listen on {address}: {error.strerror or error}") from None
        self.endpoints = [(str(sock.getsockname()[0]), int(sock.getsockname()[1])) for sock in self.listeners]
        self.connections: List[ServerConnection] = []
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="commlib-root-address-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            now = time.monotonic()
            for connection in [c for c in self.connections if c.deadline <= now]:
                self._drop(connection, f"the handshake timed out after {self.handshake_timeout:g} s")
            for key, _ in self.selector.select(0.1):
                if key.data is None:
                    self._accept(key.fileobj)  # type: ignore[arg-type]
                else:
                    self._advance(key.data)

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(16):
            try:
                sock, address = listener.accept()
            except OSError:  # nothing waits, or out of descriptors: the next round retries
                return
            source = f"{_bracketed(address[0])}:{address[1]}"
            if len(self.connections) >= MAX_HALF_OPEN:  # a rank authenticates in milliseconds: the oldest is idle
                oldest = self.connections[0]
                self._drop(oldest, f"{MAX_HALF_OPEN} connections were authenticating at once; the oldest made room")
            sock.setblocking(False)
            handshake = ServerHandshake(self.secret, "probe", self.token)
            connection = ServerConnection(sock, source, handshake, time.monotonic() + self.handshake_timeout)
            self.connections.append(connection)
            self.selector.register(sock, selectors.EVENT_WRITE, connection)
            self._advance(connection)

    def _advance(self, connection: ServerConnection) -> None:
        state = connection.step()
        if state == "open":  # the CONFIRM (with the token) went: nothing more to say
            self._drop(connection, None)
        elif state == "refused":
            self._drop(connection, connection.refusal)
        else:
            events = selectors.EVENT_WRITE if connection.wants_write else selectors.EVENT_READ
            self.selector.modify(connection.sock, events, connection)

    def _drop(self, connection: ServerConnection, why: Optional[str]) -> None:
        if why is not None:
            self.refusals.refuse(connection.source, why)
        self.connections.remove(connection)
        try:
            self.selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()

    def close(self) -> None:
        self._closed = True
        self._thread.join()
        for connection in list(self.connections):
            self._drop(connection, None)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for listener in self.listeners:
            listener.close()
        self.selector.close()
