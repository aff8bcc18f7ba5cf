"""The frames of a group's point-to-point channel over sockets (:mod:`.p2p_engine`).

Every frame is one 56-byte header, followed by payload for EAGER and DATA frames only::

    magic "CLPP" | type u8 | flags u8 | reserved u16 | job id (8) | group (8)
    | message id u64 | tag u32 | length u32 | offset u64 | total u64

A message (one ``send``) has an id, numbered by its sender per connection, a tag and a size
(``total``). How it travels depends on that size:

* EAGER (``total`` at most the eager limit): header and payload at once. ``length == total``.
* RTS, then DATA (larger): the sender announces the message (RTS: id, tag, total, no payload)
  and sends its bytes only once the receiver matched it to a posted receive and said so (CTS:
  the id). DATA frames carry ``length`` bytes at ``offset`` of the message, at most
  ``frame_bytes`` each.
* DECLINE (the id): the receiver matched the message to a receive of another size; the receive
  failed, the sender's send is complete, no byte of it travels.
* CANCEL (the id, ``offset``: the bytes of it sent): the sender gave up on a message it
  announced (its send timed out); the receiver forgets it or, when bytes arrived already, fails
  the receive they were for.
* GOODBYE: the sender closed its group; what it sent before still counts.

Nothing in a header is trusted before it is checked: a header that names another job or group,
an unknown type, an EAGER above the eager limit, a DATA above the frame size or past its
message's end, or a control frame with payload is a :class:`FrameError`, and the connection is
unusable after it. Sizes announced by an RTS allocate nothing (they are compared with a posted
receive's); the only buffers sized by a header are EAGER payloads, which the eager limit bounds.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from commlib.units import format_bytes

__all__ = ["P2PCodec", "P2PFrame", "FrameError", "EAGER", "RTS", "CTS", "DECLINE", "CANCEL", "DATA", "GOODBYE",
           "HEADER_BYTES", "FRAME_NAMES"]

EAGER, RTS, CTS, DECLINE, CANCEL, DATA, GOODBYE = range(1, 8)
FRAME_NAMES = {EAGER: "EAGER", RTS: "RTS", CTS: "CTS", DECLINE: "DECLINE", CANCEL: "CANCEL", DATA: "DATA",
               GOODBYE: "GOODBYE"}
MAGIC = b"CLPP"
_HEADER = struct.Struct("<4sBBH8s8sQIIQQ")
HEADER_BYTES = _HEADER.size
_MAX_TOTAL = 1 << 62  # larger than any buffer; keeps offset + length from overflowing anything


class P2PFrame(NamedTuple):
    type: int
    message: int
    tag: int
    length: int
    offset: int
    total: int


class FrameError(Exception):
    """A header no commlib peer of this group sends (the connection is unusable after it)."""


class P2PCodec:
    """Headers of one group's point-to-point connections (job id and group bound in)."""

    def __init__(self, job_id: bytes, group: bytes, eager_bytes: int, frame_bytes: int):
        self.job_id, self.group = job_id, group
        self.eager_bytes, self.frame_bytes = eager_bytes, frame_bytes

    def header(self, kind: int, message: int, tag: int = 0, length: int = 0, offset: int = 0, total: int = 0) -> bytes:
        return _HEADER.pack(MAGIC, kind, 0, 0, self.job_id, self.group, message, tag, length, offset, total)

    def parse(self, header) -> P2PFrame:
        """The frame a complete header announces, checked (see the module docstring)."""
        magic, kind, _, _, job_id, group, message, tag, length, offset, total = _HEADER.unpack_from(header)
        if magic != MAGIC:
            raise FrameError(f"a header that is not a commlib point-to-point frame (starts {bytes(header[:8])!r})")
        if job_id != self.job_id:
            raise FrameError(f"a frame of another job ({job_id.hex()}, this is {self.job_id.hex()})")
        if group != self.group:
            raise FrameError(f"a frame of another group ({group.hex()}, this is {self.group.hex()})")
        name = FRAME_NAMES.get(kind)
        if name is None:
            raise FrameError(f"a frame of unknown type {kind}")
        if total > _MAX_TOTAL or offset > total:
            raise FrameError(f"a {name} frame at byte {offset} of a message of {total} bytes")
        if kind == EAGER:
            if length != total or offset:
                raise FrameError(f"an EAGER frame of {length} bytes for a message of {total}")
            if length > self.eager_bytes:
                raise FrameError(f"an EAGER frame of {format_bytes(length)}, above the eager limit of "
                                 f"{format_bytes(self.eager_bytes)}")
        elif kind == DATA:
            if length > self.frame_bytes or offset + length > total or not length:
                raise FrameError(f"a DATA frame of {format_bytes(length)} at byte {offset} of a message of "
                                 f"{format_bytes(total)} (frames carry 1 B .. {format_bytes(self.frame_bytes)})")
        elif length:
            raise FrameError(f"a {name} frame with {length} bytes of payload")
        return P2PFrame(kind, message, tag, length, offset, total)
