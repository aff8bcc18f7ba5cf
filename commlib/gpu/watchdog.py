"""The watchdog: notices GPU collectives that never finish, and ends them.

A GPU collective returns to the caller once it is *enqueued*; if a peer never joins, its NCCL
kernel spins on the GPU forever and the next ``synchronize`` (or the next kernel on that stream)
hangs with it. One thread per GPU backend polls the done event of every collective in flight;
when one passes its deadline, it calls ``on_timeout(work)`` (the backend poisons the group),
fails every work still in flight with the error ``on_timeout`` returned for it, then calls
``after_failing()`` (the backend aborts the NCCL communicator, which makes stuck kernels return).

The watchdog knows nothing of CUDA: a tracked work has ``done_probe()`` (CUDA: ``event.done``),
``deadline`` (``time.monotonic``), ``is_completed()`` and ``_complete(error)``. That keeps it
testable on a machine without a GPU.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, List, Optional, Protocol

from commlib.errors import CommError

__all__ = ["Watchdog"]

POLL_SECONDS = 1e-3      # while collectives are in flight
IDLE_SECONDS = 0.5       # re-check for close() when idle


class TrackedWork(Protocol):
    deadline: float

    def done_probe(self) -> bool: ...

    def is_completed(self) -> bool: ...

    def complete(self, error: Optional[BaseException] = None) -> None: ...


class Watchdog:
    def __init__(self, name: str, on_timeout: Callable[[TrackedWork], Callable[[TrackedWork], BaseException]],
                 *, after_failing: Optional[Callable[[], None]] = None, poll_seconds: float = POLL_SECONDS,
                 thread_setup: Optional[Callable[[], None]] = None):
        """``on_timeout(expired)`` runs once, on the watchdog thread, and returns ``error_for(work)``;
        ``after_failing()`` runs once the works were failed (the abort: it may take a while, and
        the callers waiting in ``synchronize`` should not wait for it)."""
        self.name = name
        self._on_timeout = on_timeout
        self._after_failing = after_failing
        self._poll = poll_seconds
        self._thread_setup = thread_setup
        self._works: List[TrackedWork] = []
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.fired = False

    def track(self, work: TrackedWork) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: watchdog closed")
            self._works.append(work)
            self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"commlib-watchdog-{self.name}",
                                                daemon=True)
                self._thread.start()

    def in_flight(self) -> int:
        with self._cond:
            return len(self._works)

    def _loop(self) -> None:
        if self._thread_setup is not None:
            self._thread_setup()
        while True:
            with self._cond:
                while not self._works and not self._closed:
                    self._cond.wait(IDLE_SECONDS)
                if self._closed and not self._works:
                    return
                works = list(self._works)
            finished, expired = self._scan(works)
            if finished or expired is not None:
                with self._cond:
                    self._works = [w for w in self._works if w not in finished]
            if expired is not None:
                self._fire(expired)
                continue
            time.sleep(self._poll)

    def _scan(self, works):
        finished = []
        now = time.monotonic()
        expired = None
        for work in works:
            if work.is_completed():       # failed elsewhere (enqueue error) or synchronize() saw it
                finished.append(work)
                continue
            try:
                done = work.done_probe()
            except Exception as exc:  # noqa: BLE001 - a CUDA error (sticky, e.g. an illegal address) surfaces here
                if sys.is_finalizing():
                    return finished, None
                work.complete(CommError(f"{work.collective} #{work.seq}: polling its done event "
                                         f"failed: {exc}"))
                finished.append(work)
                continue
            if done:
                work.complete(None)
                finished.append(work)
            elif now >= work.deadline and expired is None:
                expired = work
        return finished, expired

    def _fire(self, expired) -> None:
        self.fired = True
        error_for = self._on_timeout(expired)
        with self._cond:
            victims, self._works = self._works, []
        # The expired work first: its error is the root cause the others' messages point to.
        victims.sort(key=lambda w: w is not expired)
        for work in victims:
            work.complete(error_for(work))
        if self._after_failing is not None:
            self._after_failing()

    def close(self, timeout: float = 5.0) -> None:
        """Stop polling. Works still in flight stay as they are (the backend drains them first)."""
        with self._cond:
            self._closed = True
            self._works = []
            self._cond.notify()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None
