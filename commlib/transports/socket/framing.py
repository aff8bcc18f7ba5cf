"""The socket transport's frames: what precedes every piece of payload on a connection.

A message (one ``(buffer, peer)`` of a ``post``) travels as frames of at most ``frame_bytes``
payload each. With checks (the default), a frame header is 56 bytes::

    magic "CLSK" | type u8 | flags u8 | reserved u16 | job id (8) | group (8)
    | seq u64 | step u32 | length u32 | offset u64 | total u64

``seq`` is the collective's sequence number, ``step`` the message's number among those this
pair exchanged in that collective (in posting order, which both ends share), ``offset`` where
the frame's payload goes in the message and ``total`` the message's size. The receiver checks
all of them against the receive it posted *before* a byte of payload is read, so a rank that
skipped a collective, or called one with another size, is a named error
(:class:`commlib.errors.CollectiveMismatchError`), and a corrupt or hostile stream cannot write
past the posted buffer (a frame announcing 100 GB is refused by its header, nothing is allocated).

Without checks (``frame_checks=False``), a header is one little-endian u64: the type in the top
byte, the length in the other 56 bits; only the length is checked (against the posted receive).

Control frames (both modes) carry a small payload: GOODBYE the last collective this end
finished (the end closed its group cleanly), ABORT who failed, how, and why (this end gave up on
the group; the receiver raises at once instead of waiting for its own timeout).
"""

from __future__ import annotations

import struct
from typing import NamedTuple, Optional, Tuple

from commlib.units import format_bytes

__all__ = ["FrameCodec", "Frame", "FrameError", "DATA", "GOODBYE", "ABORT", "MAX_CONTROL_BYTES",
           "ABORT_EXITED", "ABORT_OTHER", "encode_goodbye", "decode_goodbye", "encode_abort", "decode_abort"]

DATA, GOODBYE, ABORT = 1, 2, 3
MAGIC = b"CLSK"
MAX_CONTROL_BYTES = 2048
ABORT_EXITED, ABORT_OTHER = 1, 2
_CHECKED = struct.Struct("<4sBBH8s8sQIIQQ")
_PLAIN = struct.Struct("<Q")
_TYPE_SHIFT = 56
_LENGTH_MASK = (1 << _TYPE_SHIFT) - 1
_GOODBYE = struct.Struct("<Q")
_ABORT = struct.Struct("<iB")


class Frame(NamedTuple):
    type: int
    seq: int
    step: int
    length: int
    offset: int
    total: int


class FrameError(Exception):
    """A header that no commlib peer of this group would send (the stream is unusable after it)."""


class FrameCodec:
    """Headers of one connection's frames: ``checked`` (job id and group bound in) or plain."""

    def __init__(self, checked: bool, job_id: bytes, group: bytes, frame_bytes: int):
        self.checked = checked
        self.job_id, self.group = job_id, group
        self.frame_bytes = frame_bytes
        self.header_bytes = _CHECKED.size if checked else _PLAIN.size

    def data_header(self, seq: int, step: int, offset: int, length: int, total: int) -> bytes:
        if self.checked:
            return _CHECKED.pack(MAGIC, DATA, 0, 0, self.job_id, self.group, seq, step, length, offset, total)
        return _PLAIN.pack(DATA << _TYPE_SHIFT | length)

    def control_frame(self, kind: int, payload: bytes) -> bytes:
        if self.checked:
            header = _CHECKED.pack(MAGIC, kind, 0, 0, self.job_id, self.group, 0, 0, len(payload), 0, len(payload))
        else:
            header = _PLAIN.pack(kind << _TYPE_SHIFT | len(payload))
        return header + payload

    def parse(self, header) -> Frame:
        """The frame a complete header announces; FrameError if no peer of this group sends it."""
        if not self.checked:
            (word,) = _PLAIN.unpack_from(header)
            kind, length = word >> _TYPE_SHIFT, word & _LENGTH_MASK
            if kind not in (DATA, GOODBYE, ABORT):
                raise FrameError(f"a frame of unknown type {kind}")
            if kind != DATA and length > MAX_CONTROL_BYTES:
                raise FrameError(f"a control frame of {format_bytes(length)}")
            return Frame(kind, -1, -1, length, -1, -1)
        magic, kind, _, _, job_id, group, seq, step, length, offset, total = _CHECKED.unpack_from(header)
        if magic != MAGIC:
            raise FrameError(f"a header that is not a commlib frame (starts {bytes(header[:8])!r})")
        if job_id != self.job_id:
            raise FrameError(f"a frame of another job ({job_id.hex()}, this is {self.job_id.hex()})")
        if group != self.group:
            raise FrameError(f"a frame of another group ({group.hex()}, this is {self.group.hex()})")
        if kind not in (DATA, GOODBYE, ABORT):
            raise FrameError(f"a frame of unknown type {kind}")
        if kind != DATA and length > MAX_CONTROL_BYTES:
            raise FrameError(f"a control frame of {format_bytes(length)}")
        return Frame(kind, seq, step, length, offset, total)

    def mismatch(self, frame: Frame, seq: int, step: int, offset: int, total: int) -> Optional[Tuple[bool, str]]:
        """None when ``frame`` is the next piece of the receive (``seq``, ``step``, ``offset`` of
        ``total`` bytes: senders cut messages into frames of ``frame_bytes``, the last shorter);
        else (is it a collective mismatch, what differs)."""
        remaining = total - offset
        if self.checked:
            if frame.seq != seq or frame.step != step:
                return True, (f"a message of collective #{frame.seq} (message {frame.step}) where this rank "
                              f"expects #{seq} (message {step})")
            if frame.total != total:
                return True, (f"a message of {format_bytes(frame.total)} where this rank posted a receive of "
                              f"{format_bytes(total)}")
            if frame.offset != offset:
                return False, f"a frame at byte {frame.offset} of the message where byte {offset} is next"
        due = min(self.frame_bytes, remaining)
        if frame.length != due:
            bound = f" (frames are at most {format_bytes(self.frame_bytes)})" if frame.length > self.frame_bytes else ""
            # Without checks a wrong length is all there is to see of a message of another size.
            return (not self.checked), (f"a frame of {format_bytes(frame.length)}{bound} where a frame of "
                                        f"{format_bytes(due)} of the posted {format_bytes(total)} was due")
        return None


def encode_goodbye(last_seq: int) -> bytes:
    return _GOODBYE.pack(max(last_seq, 0))


def decode_goodbye(payload: bytes) -> int:
    if len(payload) != _GOODBYE.size:
        raise FrameError(f"a GOODBYE of {len(payload)} bytes")
    return _GOODBYE.unpack(payload)[0]


def encode_abort(culprit: int, kind: int, text: str) -> bytes:
    return _ABORT.pack(culprit, kind) + text.encode(errors="replace")[:MAX_CONTROL_BYTES - _ABORT.size]


def decode_abort(payload: bytes) -> Tuple[int, int, str]:
    if len(payload) < _ABORT.size:
        raise FrameError(f"an ABORT of {len(payload)} bytes")
    culprit, kind = _ABORT.unpack_from(payload)
    return culprit, kind, payload[_ABORT.size:].decode(errors="replace")
