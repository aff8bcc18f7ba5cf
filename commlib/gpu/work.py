"""``GpuWork``: the handle of an asynchronous GPU collective.

Three moments matter: *enqueued* (the communication thread issued the collective on the comm
stream and recorded its done event; an error before this point, such as a host-staged MPI
timeout, is the enqueue error), *done* (the done event fired on the GPU, seen by the watchdog or
by ``synchronize``), and *failed* (an enqueue error, or the watchdog's timeout).

``wait()`` waits for the enqueue on the CPU, re-raises any error, then makes the caller's current
stream wait on the done event and returns without blocking on the GPU (torch semantics; DDP's
final callback relies on it). ``synchronize()`` blocks the CPU until done. ``is_completed()``
and ``add_done_callback`` refer to *done*. The arrays the collective touches stay referenced
(``keepalive``) until done, so no caching allocator reuses their memory while the comm stream
still reads or writes it.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from commlib.errors import CommError
from commlib.execution.work import Work

__all__ = ["GpuWork"]


class GpuWork(Work):
    __slots__ = ("_inner", "done_event", "deadline", "_comm_stream")

    def __init__(self, collective: str, nbytes: int, result, comm_stream, deadline: float):
        super().__init__(collective, 0, nbytes, result)
        self._inner: Optional[Work] = None
        self.done_event: Any = None  # the comm stream's event, once the collective is enqueued
        self.deadline = deadline
        self._comm_stream = comm_stream

    # -- runtime side ---------------------------------------------------------------------------
    def attach(self, inner: Work) -> None:
        """Follow the executor's ``Work`` of the enqueue (async collectives)."""
        self._inner = inner
        self.seq = inner.seq  # None until the collective starts; the backend's task sets it then
        inner.when_complete(self._on_enqueued)

    def _on_enqueued(self, inner: Work) -> None:
        error = inner.exception()
        if error is not None:
            self.complete(error)

    def done_probe(self) -> bool:
        """Has the done event fired? A CUDA error while asking fails the work (and counts as done)."""
        event = self.done_event
        if event is None:
            return False
        try:
            return event.done
        except Exception as exc:  # noqa: BLE001 - sticky CUDA errors (illegal address ...) surface on any query
            self.complete(CommError(f"{self.collective} #{self.seq}: polling its done event failed: {exc}"))
            return True

    def has_run(self) -> bool:
        inner = self._inner
        return inner.has_run() if inner is not None else self._done.is_set()

    def settle(self) -> None:
        """An ordered callback sees the GPU's result: block until done (an error stays on the work)."""
        try:
            self.synchronize()
        except Exception:  # noqa: BLE001 - the callback reads it through exception()
            pass

    # -- user side ------------------------------------------------------------------------------
    def add_done_callback(self, callback) -> None:
        """Ordered like a CPU work's callbacks (after the enqueue's place in the group's order);
        the callback runs once the GPU finished the collective."""
        inner = self._inner
        if inner is None or inner._executor is None:
            self.when_complete(callback)
        else:
            inner._executor.add_callback(self, callback, after=inner)

    def _wait_enqueued(self, timeout: Optional[float]) -> None:
        inner = self._inner
        if inner is not None:
            inner.wait(timeout)  # re-raises the enqueue error
        if self._error is not None:
            raise self._error

    def is_completed(self) -> bool:
        if self._done.is_set():
            return True
        inner = self._inner
        if inner is not None and inner.is_completed() and inner.exception() is not None:
            self.complete(inner.exception())
            return True
        if self.done_probe():
            self.complete(None)
            return True
        return False

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Order the caller's current stream after the collective; the CPU does not wait for the GPU.

        ``timeout`` bounds only the CPU wait for the enqueue (seconds).
        """
        if timeout is not None and timeout < 0:
            raise ValueError(f"Work.wait: timeout must be >= 0 seconds or None, got {timeout!r}")
        self._wait_enqueued(timeout)
        cupy = _cupy()
        with cupy.cuda.Device(self._comm_stream.device):
            cupy.cuda.get_current_stream().wait_event(self.done_event)
        return True

    def synchronize(self) -> bool:
        """Block the CPU until the collective finished on the GPU (or the watchdog failed it)."""
        self._wait_enqueued(None)
        delay = 0.0
        while not self._done.is_set():
            if self.done_probe():
                self.complete(None)
                break
            # Short sleeps first: small collectives finish within microseconds.
            time.sleep(delay)
            delay = min(max(delay * 2, 2e-5), 1e-3)
        if self._error is not None:
            raise self._error
        return True

    def __repr__(self) -> str:
        state = "pending" if not self.is_completed() else ("ok" if self._error is None else "failed")
        return f"<GpuWork {self.collective} #{self.seq} {state}>"


def _cupy():
    import cupy

    return cupy
