"""A store in one file (``file:///path``): for ranks that share a file system but not a network
port they could agree on (torch's ``FileStore`` plays the same part).

The file is an append-only log of records (``u8 kind | u32 key length | key | u32 value
length | value``; kind 1 sets, 2 deletes), written under an exclusive ``flock`` and read under a
shared one, so every record is whole when read. Each client keeps the state it has replayed
and the offset it read to, and reads only what was appended since. Blocking calls poll (1 ms,
doubling to 50 ms). The file is created with mode 0600 (a job secret may pass through it) and
left in place: :meth:`FileStore.unlink` removes it, once no rank needs it.

``flock`` on a network file system is only as good as that file system's locking (NFSv4 and
Lustre honour it; some FUSE file systems do not).
"""

from __future__ import annotations

import fcntl
import os
import struct
import time
from typing import Dict, List, Optional, Sequence

from commlib.errors import CommError
from commlib.rendezvous.store import Store, Value, as_value, check_key

__all__ = ["FileStore"]

_HEADER = struct.Struct("<BI")
_LENGTH = struct.Struct("<I")
_SET, _DELETE = 1, 2
_MAX_RECORD_BYTES = 1 << 30


class FileStore(Store):
    def __init__(self, path: str, *, timeout: float = 300.0):
        self.path = os.path.abspath(path)
        self.timeout = self.resolve_timeout(timeout)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as error:
            raise CommError(f"store {self.describe()}: cannot open it ({error.strerror})") from None
        self._offset = 0
        self._data: Dict[bytes, bytes] = {}

    def describe(self) -> str:
        return f"file://{self.path}"

    # -- the log -----------------------------------------------------------------------------
    def _catch_up(self) -> None:
        """Replay what was appended since the last read (the caller holds a lock)."""
        size = os.fstat(self._fd).st_size
        if size <= self._offset:
            return
        chunk = os.pread(self._fd, size - self._offset, self._offset)
        view = memoryview(chunk)
        position = 0
        while position < len(view):
            if position + _HEADER.size > len(view):
                raise CommError(f"store {self.describe()}: a record cut short at byte {self._offset + position} "
                                f"(the file was changed by something else than a FileStore?)")
            kind, key_length = _HEADER.unpack_from(view, position)
            start = position + _HEADER.size
            key = bytes(view[start:start + key_length])
            if start + key_length + _LENGTH.size > len(view):
                raise CommError(f"store {self.describe()}: a record cut short at byte {self._offset + position}")
            (value_length,) = _LENGTH.unpack_from(view, start + key_length)
            value_start = start + key_length + _LENGTH.size
            if kind not in (_SET, _DELETE) or value_start + value_length > len(view) or len(key) != key_length:
                raise CommError(f"store {self.describe()}: a malformed record at byte {self._offset + position}")
            if kind == _SET:
                self._data[key] = bytes(view[value_start:value_start + value_length])
            else:
                self._data.pop(key, None)
            position = value_start + value_length
        self._offset += position

    def _append(self, kind: int, key: bytes, value: bytes = b"") -> None:
        if len(value) > _MAX_RECORD_BYTES:
            raise CommError(f"store {self.describe()}: a value of {len(value)} bytes; at most {_MAX_RECORD_BYTES}")
        os.write(self._fd, _HEADER.pack(kind, len(key)) + key + _LENGTH.pack(len(value)) + value)

    def _locked(self, exclusive: bool):
        return _Flock(self._fd, exclusive)

    def _snapshot(self, keys: Sequence[bytes]) -> List[Optional[bytes]]:
        with self._locked(False):
            self._catch_up()
            return [self._data.get(key) for key in keys]

    # -- the operations ----------------------------------------------------------------------
    def set(self, key: str, value: Value) -> None:
        encoded, data = check_key(key), as_value(value)
        with self._locked(True):
            self._catch_up()
            self._append(_SET, encoded, data)
            self._catch_up()

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        return self.multi_get([key], timeout)[0]

    def multi_get(self, keys: Sequence[str], timeout: Optional[float] = None) -> List[bytes]:
        seconds = self.resolve_timeout(timeout)
        encoded = [check_key(key) for key in keys]
        deadline = time.monotonic() + seconds
        pause = 1e-3
        while True:
            values = self._snapshot(encoded)
            missing = [key for key, value in zip(keys, values) if value is None]
            if not missing:
                return values  # type: ignore[return-value]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.timeout_error(f"multi_get of {len(keys)} keys" if len(keys) > 1 else "get", missing,
                                         seconds)
            time.sleep(min(pause, remaining))
            pause = min(pause * 2, 0.05)

    def add(self, key: str, amount: int) -> int:
        encoded = check_key(key)
        with self._locked(True):
            self._catch_up()
            current = self._data.get(encoded, b"0")
            try:
                total = int(current) + int(amount)
            except ValueError:
                raise CommError(f"store {self.describe()}: add to {key!r}, which holds {current[:32]!r}, "
                                f"not an integer") from None
            self._append(_SET, encoded, str(total).encode())
            self._catch_up()
            return total

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        encoded, expected_bytes, desired_bytes = check_key(key), as_value(expected), as_value(desired)
        with self._locked(True):
            self._catch_up()
            current = self._data.get(encoded)
            if (current is None and not expected_bytes) or (current is not None and current == expected_bytes):
                self._append(_SET, encoded, desired_bytes)
                self._catch_up()
                return desired_bytes
            return expected_bytes if current is None else current

    def check(self, keys: Sequence[str]) -> bool:
        return all(value is not None for value in self._snapshot([check_key(key) for key in keys]))

    def missing(self, keys: Sequence[str]) -> List[str]:
        values = self._snapshot([check_key(key) for key in keys])
        return [key for key, value in zip(keys, values) if value is None]

    def delete_key(self, key: str) -> bool:
        encoded = check_key(key)
        with self._locked(True):
            self._catch_up()
            if encoded not in self._data:
                return False
            self._append(_DELETE, encoded)
            self._catch_up()
            return True

    def num_keys(self) -> int:
        with self._locked(False):
            self._catch_up()
            return len(self._data)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Remove the file (other clients keep what they read; new ones start empty)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class _Flock:
    __slots__ = ("fd", "exclusive")

    def __init__(self, fd: int, exclusive: bool):
        self.fd, self.exclusive = fd, exclusive

    def __enter__(self) -> None:
        if self.fd < 0:
            raise CommError("store: the FileStore is closed")
        fcntl.flock(self.fd, fcntl.LOCK_EX if self.exclusive else fcntl.LOCK_SH)

    def __exit__(self, *exc) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
