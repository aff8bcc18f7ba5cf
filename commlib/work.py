"""``Work``: the handle of an asynchronous collective.

A ``Work`` is completed exactly once, by the thread that ran the collective, with either success
or the exception that ended it; ``wait()`` re-raises that exception in the caller's thread, so an
error on the communication thread is never swallowed. Callbacks added with
``add_done_callback`` run on the completing thread (torch futures are completed this way).
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional

from .errors import CommTimeoutError

__all__ = ["Work"]


class Work:
    __slots__ = ("collective", "seq", "nbytes", "_result", "_done", "_error", "_callbacks", "_lock",
                 "keepalive")

    def __init__(self, collective: str, seq: int, nbytes: int = 0, result=None):
        self.collective = collective
        self.seq = seq
        self.nbytes = nbytes
        self._result = result
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self._callbacks: List[Callable[["Work"], None]] = []
        self._lock = threading.Lock()
        # Arrays the collective reads or writes stay referenced until it completes.
        self.keepalive = None

    # -- completion (runtime side) --------------------------------------------------------------
    def _complete(self, error: Optional[BaseException] = None) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        self.keepalive = None
        for callback in callbacks:
            callback(self)

    # -- user side ------------------------------------------------------------------------------
    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the collective completed; re-raise its error. ``timeout`` in seconds."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"Work.wait: timeout must be >= 0 seconds or None, got {timeout!r}")
        if not self._done.wait(timeout):
            raise CommTimeoutError(
                f"{self.collective} #{self.seq}: Work.wait gave up after {timeout:g} s; "
                f"the collective is still running"
            )
        if self._error is not None:
            raise self._error
        return True

    def synchronize(self) -> bool:
        """Block the CPU until done (on CPU the same as ``wait``; GPU work overrides ``wait``)."""
        return Work.wait(self)

    def result(self):
        """The buffer the collective wrote, after waiting for it."""
        self.wait()
        return self._result

    def add_done_callback(self, callback: Callable[["Work"], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def __repr__(self) -> str:
        state = "pending" if not self.is_completed() else ("ok" if self._error is None else "failed")
        return f"<Work {self.collective} #{self.seq} {state}>"
