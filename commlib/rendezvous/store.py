"""A key-value store: how ranks without MPI find each other (the contract).

The operations are torch's ``c10d.Store``'s, with the same meaning, so that a torch store can
stand in for ours (:class:`commlib.rendezvous.torch_store.TorchStore`) and a rendezvous written
against this class runs over either:

* ``set(key, value)``; ``get(key, timeout)`` blocks until the key exists;
* ``add(key, amount)``: the key holds a decimal integer (missing: 0), returns the new value;
* ``compare_set(key, expected, desired)``: sets ``desired`` when the key holds ``expected`` (or
  is missing and ``expected`` is empty), and returns what the key holds afterwards (missing and
  ``expected`` not empty: ``expected``, as torch does);
* ``wait(keys, timeout)``, ``check(keys)``, ``delete_key(key)``, ``num_keys()``;
* ``multi_get(keys, timeout)``: every value once every key exists (one round trip where the
  store can).

Keys are ``str``, values ``bytes`` (a ``str`` value is encoded as UTF-8). Every blocking call
ends in :class:`commlib.errors.CommTimeoutError` naming the keys still missing once ``timeout``
seconds (default: the store's ``timeout``) have passed.

Implementations: :class:`commlib.rendezvous.tcp_store.TCPStore` (a server run by rank 0 or
standalone, authenticated with the job secret), :class:`commlib.rendezvous.file_store.FileStore`
(one file on a file system every rank sees, ``file://``), and the adapter of a torch store.
"""

from __future__ import annotations

import abc
from typing import List, Optional, Sequence, Union

from commlib.errors import CommTimeoutError, InvalidUsageError

__all__ = ["Store", "as_value", "check_key", "MAX_KEY_BYTES"]

MAX_KEY_BYTES = 4096

Value = Union[bytes, bytearray, memoryview, str]


def as_value(value: Value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise InvalidUsageError(f"a store value must be bytes or str, got {type(value).__name__}")


def check_key(key: str) -> bytes:
    """``key`` as UTF-8, checked: a non-empty ``str`` of at most :data:`MAX_KEY_BYTES` bytes."""
    if not isinstance(key, str) or not key:
        raise InvalidUsageError(f"a store key must be a non-empty str, got {key!r}")
    encoded = key.encode()
    if len(encoded) > MAX_KEY_BYTES:
        raise InvalidUsageError(f"store key of {len(encoded)} bytes: at most {MAX_KEY_BYTES}")
    return encoded


class Store(abc.ABC):
    """A key-value store shared by the ranks of a job (see the module docstring)."""

    #: Default seconds a blocking call waits.
    timeout: float = 300.0

    @abc.abstractmethod
    def set(self, key: str, value: Value) -> None:
        """Set ``key`` to ``value`` (replacing what it held)."""

    @abc.abstractmethod
    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        """The value of ``key``, once it exists."""

    @abc.abstractmethod
    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the integer ``key`` holds (missing: 0) and return the sum."""

    @abc.abstractmethod
    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        """Set ``desired`` if ``key`` holds ``expected`` (or is missing and ``expected`` is empty)."""

    @abc.abstractmethod
    def check(self, keys: Sequence[str]) -> bool:
        """Whether every key of ``keys`` exists now (never blocks)."""

    @abc.abstractmethod
    def delete_key(self, key: str) -> bool:
        """Remove ``key``; whether it existed."""

    @abc.abstractmethod
    def num_keys(self) -> int:
        """How many keys the store holds."""

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        """Return once every key of ``keys`` exists; ``CommTimeoutError`` naming the missing ones."""
        self.multi_get(keys, timeout)

    def multi_get(self, keys: Sequence[str], timeout: Optional[float] = None) -> List[bytes]:
        """The values of ``keys``, in order, once every one exists."""
        return [self.get(key, timeout) for key in keys]

    def missing(self, keys: Sequence[str]) -> List[str]:
        """The keys of ``keys`` that do not exist now."""
        return [key for key in keys if not self.check([key])]

    def describe(self) -> str:
        """Where the store is, for messages (``tcp://host:port``, ``file:///path``)."""
        return type(self).__name__

    def close(self) -> None:  # noqa: B027 - optional: a store may hold nothing to release
        """Release the connection (and a server this client owns). Idempotent."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def timeout_error(self, operation: str, missing: Sequence[str], timeout: float) -> CommTimeoutError:
        shown = ", ".join(repr(key) for key in list(missing)[:8]) + (" ..." if len(missing) > 8 else "")
        return CommTimeoutError(f"store {self.describe()}: {operation} timed out after {timeout:g} s; "
                                f"still missing {len(missing)} key{'s' if len(missing) != 1 else ''}: {shown}")

    def resolve_timeout(self, timeout: Optional[float]) -> float:
        value = self.timeout if timeout is None else float(timeout)
        if not value >= 0:
            raise InvalidUsageError(f"store timeout must be >= 0 seconds, got {timeout!r}")
        return value
