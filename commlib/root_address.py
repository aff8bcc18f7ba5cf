"""An address of rank 0's host that every rank can reach, found without DNS.

A TCP rendezvous (torch's ``TCPStore``) needs an address of rank 0. The host name often does not
resolve on the other hosts (nor on its own: many clusters have no DNS entry for their nodes), so
rank 0 lists its own interface addresses instead, sends them over MPI with the port of a probe
listener and a random token, and every other rank tries them in turn: the first address where
the probe answers with the token wins (the token rules out a different listener on the same
port, e.g. on an address that exists on every host, like a container bridge's). When a rank
reaches none, every rank raises the same error naming, per failed rank, each address tried and
what happened.
"""

from __future__ import annotations

import fcntl
import ipaddress
import secrets
import socket
import struct
import threading
from typing import List, Optional, Tuple

from .errors import CommError

__all__ = ["reachable_root_address", "interface_addresses"]

_SIOCGIFFLAGS, _SIOCGIFADDR = 0x8913, 0x8915  # Linux ioctls: interface flags, IPv4 address
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8


def interface_addresses() -> List[str]:
    """This host's usable addresses: up, not loopback, not link-local; IPv4 first (Linux).

    Elsewhere (no such ioctls), the host name's addresses if it resolves, else none.
    """
    found: List[str] = []
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                flags = struct.unpack_from("H", fcntl.ioctl(probe.fileno(), _SIOCGIFFLAGS, request), 16)[0]
                if not flags & _IFF_UP or flags & _IFF_LOOPBACK:
                    continue
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24]
            except OSError:  # no IPv4 address on this interface, or not Linux
                continue
            found.append(socket.inet_ntoa(packed))
    finally:
        probe.close()
    found += _global_ipv6_addresses()
    if not found:
        try:
            found = [str(info[4][0]) for info in socket.getaddrinfo(socket.gethostname(), None)]
        except OSError:
            pass
    usable = []
    for text in found:
        address = ipaddress.ip_address(text.split("%")[0])
        if not (address.is_loopback or address.is_link_local or address.is_unspecified) and text not in usable:
            usable.append(text)
    return usable


def _global_ipv6_addresses() -> List[str]:
    try:
        with open("/proc/net/if_inet6") as table:
            rows = [line.split() for line in table]
    except OSError:
        return []
    # columns: address (32 hex digits), interface index, prefix length, scope, flags, name
    return [str(ipaddress.IPv6Address(bytes.fromhex(row[0]))) for row in rows
            if len(row) >= 6 and row[3] == "00" and row[5] != "lo"]


def reachable_root_address(comm, connect_timeout: float = 5.0) -> str:
    """Collective over ``comm``: the address this rank should use to reach rank 0's host.

    Rank 0 gets ``127.0.0.1``; so does everyone when all ranks share one host.
    """
    from mpi4py import MPI

    hosts = comm.allgather(MPI.Get_processor_name())
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    rank = comm.Get_rank()
    listener: Optional[_ProbeListener] = None
    offer: Optional[Tuple[List[str], int, bytes]] = None
    if rank == 0:
        candidates = interface_addresses()
        if candidates:
            listener = _ProbeListener(secrets.token_bytes(16))
            offer = (candidates, listener.port, listener.token)
    offer = comm.bcast(offer, root=0)
    if offer is None:
        raise CommError(f"rank {rank}: rank 0 (host {hosts[0]}) has no network address other ranks "
                        f"could reach (only loopback or link-local); set MASTER_ADDR and MASTER_PORT")
    candidates, port, token = offer
    chosen, attempts = ("127.0.0.1", []) if rank == 0 else _first_reachable(candidates, port, token, connect_timeout)
    reports = comm.gather((chosen, attempts), root=0)
    if listener is not None:
        listener.close()
    failures = None
    if rank == 0:
        failures = [f"rank {peer} on host {hosts[peer]} tried "
                    + ", ".join(f"{address} ({why})" for address, why in tried)
                    for peer, (address, tried) in enumerate(reports) if address is None]
    failures = comm.bcast(failures, root=0)
    if failures:
        raise CommError(f"rank {rank}: no address of rank 0's host {hosts[0]} was reachable from every "
                        f"rank (probe port {offer[1]}): {'; '.join(failures)}. Set MASTER_ADDR (and "
                        f"MASTER_PORT) to an address of rank 0's host that every host can reach")
    assert chosen is not None  # a rank that reached none is in failures, and every rank raised
    return chosen


def _first_reachable(candidates, port: int, token: bytes, connect_timeout: float
                     ) -> Tuple[Optional[str], List[Tuple[str, str]]]:
    attempts: List[Tuple[str, str]] = []
    for address in candidates:
        try:
            with socket.create_connection((address, port), timeout=connect_timeout) as connection:
                answer = b""
                while len(answer) < len(token):
                    chunk = connection.recv(len(token) - len(answer))
                    if not chunk:
                        break
                    answer += chunk
            if answer == token:
                return address, attempts
            attempts.append((f"{_bracketed(address)}:{port}", "a different service answered"))
        except socket.timeout:
            attempts.append((f"{_bracketed(address)}:{port}", f"no answer within {connect_timeout:g} s"))
        except OSError as error:
            attempts.append((f"{_bracketed(address)}:{port}", error.strerror or type(error).__name__))
    return None, attempts


def _bracketed(address: str) -> str:
    return f"[{address}]" if ":" in address else address


class _ProbeListener:
    """Rank 0's probe: answers every connection with the token (on a thread, until closed)."""

    def __init__(self, token: bytes):
        self.token = token
        try:
            self._socket = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
        except (OSError, ValueError):  # no IPv6 on this host
            self._socket = socket.create_server(("", 0))
        self.port = self._socket.getsockname()[1]
        self._socket.settimeout(0.1)  # how often the thread looks at _closed
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="commlib-root-address-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._socket.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with connection:
                try:
                    connection.sendall(self.token)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._thread.join()
        self._socket.close()
