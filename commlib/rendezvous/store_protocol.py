"""The TCP store's wire format, after the handshake: bounded frames of length-prefixed fields.

A frame is ``u32 body length | body``; a body is ``u8 code`` followed by fields, each ``u32 length
| bytes``. Requests carry an operation code, replies a status. Nothing is ever unpickled or
evaluated: keys and values are bytes, integers are 8-byte little-endian fields. A frame longer
than the reader's bound, or a body whose fields do not add up, is a :class:`ProtocolError`
before any of it is acted on (a peer announcing 100 GB gets an error, not an allocation).
"""

from __future__ import annotations

import struct
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple

from commlib.errors import CommError

__all__ = ["ProtocolError", "FrameReader", "encode", "decode", "pack_int", "unpack_int", "Op", "Status",
           "FRAME_OVERHEAD_BYTES", "MAX_FIELDS"]

_LENGTH = struct.Struct("<I")
_INT = struct.Struct("<q")
#: Room a frame needs beyond its largest value (the code, field lengths, a key, a timeout).
FRAME_OVERHEAD_BYTES = 64 << 10
MAX_FIELDS = 1 << 16


class Op:
    SET, GET, ADD, COMPARE_SET, MULTI_GET, CHECK, DELETE, NUM_KEYS, PING, SET_EPHEMERAL = range(1, 11)
    NAMES: ClassVar[Dict[int, str]] = {SET: "set", GET: "get", ADD: "add", COMPARE_SET: "compare_set",
                                       MULTI_GET: "multi_get", CHECK: "check", DELETE: "delete_key",
                                       NUM_KEYS: "num_keys", PING: "ping", SET_EPHEMERAL: "set_ephemeral"}


class Status:
    OK, TIMEOUT, ERROR = 0, 1, 2


class ProtocolError(CommError):
    """Bytes that are not a well-formed store frame (the connection is closed on it)."""


def pack_int(value: int) -> bytes:
    return _INT.pack(value)


def unpack_int(field: bytes) -> int:
    if len(field) != _INT.size:
        raise ProtocolError(f"an integer field has {len(field)} bytes, expected {_INT.size}")
    return _INT.unpack(field)[0]


def encode(code: int, fields: Sequence[bytes] = ()) -> bytes:
    parts = [b"", bytes((code,))]
    for field in fields:
        parts.append(_LENGTH.pack(len(field)))
        parts.append(field)
    body_length = sum(len(part) for part in parts)
    parts[0] = _LENGTH.pack(body_length)
    return b"".join(parts)


def decode(body: bytes) -> Tuple[int, List[bytes]]:
    """(code, fields) of a frame's body; ProtocolError when the fields do not fill it exactly."""
    if not body:
        raise ProtocolError("an empty frame")
    view = memoryview(body)
    fields: List[bytes] = []
    position = 1
    while position < len(view):
        if len(fields) >= MAX_FIELDS:
            raise ProtocolError(f"more than {MAX_FIELDS} fields in one frame")
        if position + _LENGTH.size > len(view):
            raise ProtocolError(f"a field length cut short at byte {position} of {len(view)}")
        (length,) = _LENGTH.unpack_from(view, position)
        position += _LENGTH.size
        if length > len(view) - position:
            raise ProtocolError(f"a field of {length} bytes at byte {position} of a {len(view)}-byte frame")
        fields.append(bytes(view[position:position + length]))
        position += length
    return body[0], fields


class FrameReader:
    """Frames out of a byte stream, each at most ``max_body`` bytes; memory stays under one frame
    plus what one ``feed`` brings."""

    def __init__(self, max_body: int):
        self.max_body = max_body
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data
        self._check_length()

    def _check_length(self) -> None:
        if len(self._buffer) >= _LENGTH.size:
            (length,) = _LENGTH.unpack_from(self._buffer)
            if length > self.max_body:
                raise ProtocolError(f"a frame announces {length} bytes; this store accepts at most {self.max_body}")

    def next_body(self) -> Optional[bytes]:
        """The next complete frame's body, or None until more bytes arrive."""
        if len(self._buffer) < _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack_from(self._buffer)
        end = _LENGTH.size + length
        if len(self._buffer) < end:
            return None
        body = bytes(self._buffer[_LENGTH.size:end])
        del self._buffer[:end]
        self._check_length()
        return body

    @property
    def buffered(self) -> int:
        return len(self._buffer)
