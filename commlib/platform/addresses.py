"""This host's network addresses: which exist, which one a name means, which one reaches a peer.

Found without DNS (cluster host names often resolve nowhere, not even on their own host):
:func:`interface_addresses` lists the addresses other hosts could reach, :func:`address_of_interface`
turns ``COMMLIB_SOCKET_IFNAME`` (a name or an address) into one, and :func:`source_address_toward`
asks the kernel's routing table which of ours it would use to reach a peer's address (a UDP
``connect`` sends nothing). What listens for the job's peers binds to those, not to every
interface of the host.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from typing import Iterable, List, Optional

from commlib.errors import InvalidUsageError

__all__ = ["interface_addresses", "address_of_interface", "source_address_toward", "reaching_addresses"]

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


def address_of_interface(name: str) -> str:
    """The IPv4 address of interface ``name`` (Linux), or ``name`` itself if it is an address."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        pass
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        request = struct.pack("256s", name.encode()[:15])
        return socket.inet_ntoa(fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)[20:24])
    except OSError as error:
        raise InvalidUsageError(f"COMMLIB_SOCKET_IFNAME={name!r}: no such interface with an IPv4 address "
                                f"({error.strerror})") from None
    finally:
        probe.close()


def source_address_toward(address: str) -> Optional[str]:
    """The address of this host that the kernel would send from to reach ``address``, or None
    (no route). Nothing is sent."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    probe = socket.socket(family, socket.SOCK_DGRAM)
    try:
        probe.connect((address, 9))
        return str(probe.getsockname()[0])
    except OSError:
        return None
    finally:
        probe.close()


def reaching_addresses(peer_addresses: Iterable[str]) -> List[str]:
    """This host's addresses that reach ``peer_addresses`` (each peer's first routable one counts
    once), in order: where a listener for those peers binds."""
    found: List[str] = []
    for peer in peer_addresses:
        source = source_address_toward(peer)
        if source is not None and source not in found and not ipaddress.ip_address(source.split("%")[0]).is_loopback:
            found.append(source)
    return found
