"""A torch ``c10d.Store`` (``TCPStore``, ``FileStore``, ``PrefixStore``, ...; what
``dist.init_process_group`` hands a backend) as a :class:`commlib.rendezvous.store.Store`.

Duck-typed: commlib never imports torch, it calls the methods every c10d store has. What torch
does differently is made to match: a blocking ``get`` waits first with ``wait(keys, timedelta)``
(a torch store's own ``get`` waits its store-wide timeout, not ours), and torch's timeout error
(``DistStoreError``, "wait timeout after ...") becomes :class:`commlib.errors.CommTimeoutError`
naming the keys still missing; any other failure becomes :class:`commlib.errors.CommError`.
"""

from __future__ import annotations

import datetime
from typing import Any, List, Optional, Sequence

from commlib.errors import CommError
from commlib.rendezvous.store import Store, Value, as_value, check_key

__all__ = ["TorchStore"]

_METHODS = ("set", "get", "add", "compare_set", "wait", "check", "delete_key", "num_keys")


class TorchStore(Store):
    """``store``: a torch c10d store object; ``timeout``: ours for blocking calls (default: the
    torch store's own ``timeout`` where it has one, else 300 s)."""

    def __init__(self, store: Any, *, timeout: Optional[float] = None):
        lacking = [name for name in _METHODS if not callable(getattr(store, name, None))]
        if lacking:
            raise CommError(f"{type(store).__name__} is not a c10d store: it has no {', '.join(lacking)}")
        self.store = store
        own = getattr(store, "timeout", None)
        default = own.total_seconds() if isinstance(own, datetime.timedelta) else 300.0
        self.timeout = self.resolve_timeout(default if timeout is None else timeout)

    def describe(self) -> str:
        host, port = getattr(self.store, "host", None), getattr(self.store, "port", None)
        where = f" at {host}:{port}" if host is not None and port is not None else ""
        return f"torch {type(self.store).__name__}{where}"

    def _failed(self, operation: str, error: Exception) -> CommError:
        return CommError(f"store {self.describe()}: {operation} failed: {error}")

    def set(self, key: str, value: Value) -> None:
        check_key(key)
        data = as_value(value)
        try:
            self.store.set(key, data)
        except Exception as error:  # noqa: BLE001 - torch's store errors have no common type we may import
            raise self._failed(f"set({key!r})", error) from None

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        return self.multi_get([key], timeout)[0]

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        seconds = self.resolve_timeout(timeout)
        for key in keys:
            check_key(key)
        if not keys:
            return
        try:
            self.store.wait(list(keys), datetime.timedelta(seconds=seconds))
        except Exception as error:  # noqa: BLE001 - see set
            if "timeout" in str(error).lower() or "timed out" in str(error).lower():
                raise self.timeout_error(f"wait for {len(keys)} key{'s' if len(keys) > 1 else ''}",
                                         self.missing(keys), seconds) from None
            raise self._failed("wait", error) from None

    def multi_get(self, keys: Sequence[str], timeout: Optional[float] = None) -> List[bytes]:
        self.wait(keys, timeout)
        try:
            many = getattr(self.store, "multi_get", None)
            values = many(list(keys)) if many is not None and len(keys) > 1 else [self.store.get(key) for key in keys]
        except Exception as error:  # noqa: BLE001 - see set
            raise self._failed(f"get of {len(keys)} keys", error) from None
        return [bytes(value) for value in values]

    def add(self, key: str, amount: int) -> int:
        check_key(key)
        try:
            return int(self.store.add(key, int(amount)))
        except Exception as error:  # noqa: BLE001 - see set
            raise self._failed(f"add({key!r})", error) from None

    def compare_set(self, key: str, expected: Value, desired: Value) -> bytes:
        check_key(key)
        expected_bytes, desired_bytes = as_value(expected), as_value(desired)
        try:
            return bytes(self.store.compare_set(key, expected_bytes, desired_bytes))
        except Exception as error:  # noqa: BLE001 - see set
            raise self._failed(f"compare_set({key!r})", error) from None

    def check(self, keys: Sequence[str]) -> bool:
        try:
            return bool(self.store.check(list(keys)))
        except Exception as error:  # noqa: BLE001 - see set
            raise self._failed("check", error) from None

    def delete_key(self, key: str) -> bool:
        try:
            # torch's FileStore says True for a key that was not there: ask first.
            existed = bool(self.store.check([key]))
            return bool(self.store.delete_key(key)) and existed
        except Exception as error:  # noqa: BLE001 - see set
            raise self._failed(f"delete_key({key!r})", error) from None

    def num_keys(self) -> int:
        try:
            return int(self.store.num_keys())
        except Exception as error:  # noqa: BLE001 - see set
            raise self._failed("num_keys", error) from None
