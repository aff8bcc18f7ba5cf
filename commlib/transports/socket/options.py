"""What the socket transport is told: the knobs of :class:`commlib.config.Config` it reads."""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["SocketOptions", "TLSFiles"]


@dataclasses.dataclass(frozen=True)
class TLSFiles:
    """PEM files of this rank's TLS identity: its certificate, its key, and the certificates its
    peers must be signed by (default: its own, so one self-signed pair can serve a whole job)."""

    cert: str
    key: str
    ca: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class SocketOptions:
    #: Frames carry job id, group, sequence number, step and offsets, checked before a byte lands
    #: in a user buffer; False: a length only (every rank must agree; see framing.py).
    frame_checks: bool = True
    #: The largest payload of one frame: a longer message goes as several.
    frame_bytes: int = 4 << 20
    #: Pipeline segment of the transport's own collectives (ring allreduce, broadcast).
    segment_bytes: int = 1 << 20
    #: Interface name or address to listen on; None: the one that reaches the store, or loopback
    #: when every rank shares one host.
    interface: Optional[str] = None
    handshake_timeout: float = 10.0
    #: How long one connection attempt to one address of a peer may take before the next is tried.
    connect_attempt_timeout: float = 3.0
    tls: Optional[TLSFiles] = None

    def __post_init__(self) -> None:
        if not 4096 <= self.frame_bytes < 1 << 32:
            raise ValueError(f"frame_bytes must be in 4 KiB .. 4 GiB, got {self.frame_bytes}")
        if self.segment_bytes < 1:
            raise ValueError(f"segment_bytes must be >= 1, got {self.segment_bytes}")

    @classmethod
    def from_config(cls, config) -> "SocketOptions":
        """The options a :class:`commlib.config.Config` sets (duck-typed: transports do not import it)."""
        tls = (TLSFiles(config.socket_tls_cert, config.socket_tls_key, config.socket_tls_ca)
               if config.socket_tls else None)
        return cls(frame_checks=config.socket_frame_checks, frame_bytes=config.socket_frame_bytes,
                   segment_bytes=config.segment_bytes, interface=config.socket_interface,
                   handshake_timeout=config.handshake_timeout, tls=tls)
