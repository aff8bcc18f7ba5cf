"""Reading a socket as a test that plays a peer byte by byte does."""

from __future__ import annotations

import socket

__all__ = ["read_exactly"]


def read_exactly(sock: socket.socket, count: int) -> bytes:
    """``count`` bytes from ``sock`` (its timeout applies to each read); EOFError if it closes first."""
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise EOFError(f"closed after {len(data)} of {count} bytes")
        data += chunk
    return data
