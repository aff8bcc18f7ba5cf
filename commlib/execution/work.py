"""``Work``: the handle of an asynchronous collective.

A ``Work`` is completed exactly once, by the thread that ran the collective, with either success
or the exception that ended it; ``wait()`` re-raises that exception in the caller's thread, so an
error on the communication thread is never swallowed.

Callbacks added with ``add_done_callback`` are *ordered*: they run on the group's communication
thread at the place in the group's issue order where they were added (see
:mod:`commlib.execution.executor`), so a callback that issues more collectives does so at the same point on
every rank. ``wait()`` called from such a callback for a collective that runs after it would wait
forever; it raises :class:`InvalidUsageError` instead.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, List, Optional, Protocol, runtime_checkable

from commlib.errors import CommTimeoutError, InvalidUsageError

__all__ = ["Work", "WorkHandle"]


@runtime_checkable
class WorkHandle(Protocol):
    """What every handle of an asynchronous operation offers, whoever made it.

    Implemented by :class:`Work` (collectives) and its kinds (``P2PWork``, the GPU backend's
    ``GpuWork``), and by the handles DDP's comm hooks return (``ddp.hooks.HookWork``,
    ``CompletedWork``); a comm hook may return one of these or a ``torch.futures.Future`` (the
    torch-style hooks do; see ``ddp.hooks.CommHook``). The torch backend's works are torch's own
    ``dist.Work`` (``wait``, ``is_completed``, ``get_future``), not this protocol.
    """

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the operation completed (True), or raise its error (or a timeout)."""

    def is_completed(self) -> bool:
        """Whether it finished (successfully or not); never blocks."""

    def result(self) -> Any:
        """``wait()``, then the operation's output (the reduced buffer, the received array, ...)."""

    def add_done_callback(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(handle)`` once it completed (for a collective: ordered, on the group's
        communication thread, see :mod:`commlib.execution.executor`)."""


class Work:
    __slots__ = ("collective", "seq", "nbytes", "completed_at", "_result", "_done", "_error",
                 "_callbacks", "_lock", "_executor", "keepalive")

    def __init__(self, collective: str, seq: Optional[int] = None, nbytes: int = 0, result=None,
                 executor=None):
        self.collective = collective
        self.seq = seq  # the group's sequence number, assigned when the collective starts running
        self.nbytes = nbytes
        self.completed_at: Optional[float] = None  # time.perf_counter() at completion
        self._result = result
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        # Run by the completing thread, in order, right after completion.
        self._callbacks: List[Callable[["Work"], None]] = []
        self._lock = threading.Lock()
        self._executor = executor  # orders add_done_callback; None: callbacks run on completion
        # Arrays the collective reads or writes stay referenced until it completes.
        self.keepalive: Any = None

    # -- completion: the runtime's side (executors, transports, the GPU watchdog) ---------------
    # Public so that every kind of work (collectives, point-to-point, GPU) is completed through
    # one interface; user code only waits and reads.
    def complete(self, error: Optional[BaseException] = None) -> None:
        """Mark the operation finished (with ``error``, or success) and run what waits on it. The
        first call counts; later ones are ignored."""
        with self._lock:
            if self._done.is_set():
                return
            self._error = error
            self.completed_at = time.perf_counter()
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        self.keepalive = None
        for callback in callbacks:
            callback(self)

    def when_complete(self, callback: Callable[["Work"], None]) -> None:
        """Run ``callback`` on the completing thread (now, if complete already).

        Unordered, unlike :meth:`add_done_callback`: only for the runtime's bookkeeping, which
        issues no collective."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def has_run(self) -> bool:
        """Has the collective's place in the group's order passed (it ran, or failed)?"""
        return self._done.is_set()

    def settle(self) -> None:
        """Called before an ordered callback runs; a GPU work waits for the GPU here."""

    # -- user side ------------------------------------------------------------------------------
    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def label(self) -> str:
        """``"allreduce #12"``: what error messages call this operation."""
        return f"{self.collective} #{self.seq}" if self.seq is not None else f"{self.collective} (not started)"

    def check_wait_allowed(self) -> None:
        """Raise instead of deadlocking: a callback on the comm thread waiting for a later collective."""
        executor = self._executor
        if executor is not None and not self.has_run() and executor.on_comm_thread():
            raise InvalidUsageError(
                f"{executor.name}: {self.label()}: wait() called on the group's communication "
                f"thread (from a done-callback or a future's callback) for a collective queued "
                f"after that callback: it can never run while the callback waits. A callback may "
                f"wait for collectives it issued itself (they complete before the call returns) "
                f"and for earlier ones; wait for later ones in your own thread"
            )

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the collective completed; re-raise its error. ``timeout`` in seconds."""
        if timeout is not None and timeout < 0:
            raise ValueError(f"Work.wait: timeout must be >= 0 seconds or None, got {timeout!r}")
        if not self._done.is_set():
            self.check_wait_allowed()
        if not self._done.wait(timeout):
            raise CommTimeoutError(
                f"{self.label()}: Work.wait gave up after {timeout:g} s; the collective is still running"
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
        """Run ``callback(work)`` once the collective completed, on the group's communication thread,
        at this point of the group's issue order (collectives it issues run right there)."""
        if self._executor is None:
            self.when_complete(callback)
        else:
            self._executor.add_callback(self, callback, after=self)

    def __repr__(self) -> str:
        state = "pending" if not self.is_completed() else ("ok" if self._error is None else "failed")
        return f"<Work {self.label()} {state}>"
