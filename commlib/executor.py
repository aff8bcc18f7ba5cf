"""Running a group's collectives in issue order: inline when idle, else on its comm thread.

Every collective of a group gets its sequence number and its place in line at issue time, under
one lock, so collectives complete in issue order whatever thread issued them. An ``async_op``
collective goes to the group's communication thread and the caller returns at once. A synchronous
one runs right in the caller's thread when nothing is queued (a thread hop costs tens of
microseconds, more than a whole small ``MPI_Allreduce``); otherwise it queues behind the others
and the caller waits for it. While an inline collective runs (``_inline_busy``), the comm thread
holds back collectives that other threads queued meanwhile, so the two never overlap.

After any collective fails, the group is poisoned: queued and later collectives fail at once
with :class:`GroupAbortedError` naming the first error, because peers may now be out of step.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

from .errors import GroupAbortedError
from .work import Work

__all__ = ["CommExecutor"]

NumberedTask = Callable[[int], None]


class CommExecutor:
    def __init__(self, name: str):
        self.name = name
        self._issue_lock = threading.Lock()
        self._inline_busy = False
        self._queue: "collections.deque[tuple[NumberedTask, int, Work]]" = collections.deque()
        self._wakeup = threading.Condition(threading.Lock())
        self._in_flight = 0  # issued and not finished, inline ones included
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self.first_error: Optional[BaseException] = None

    # -- issuing -------------------------------------------------------------------------------
    def check_healthy(self) -> None:
        if self.first_error is not None:
            raise GroupAbortedError(
                f"{self.name}: unusable after an earlier error: {self.first_error}"
            ) from self.first_error
        if self._closed:
            raise GroupAbortedError(f"{self.name}: the group was closed")

    def run_sync(self, task: NumberedTask, next_seq: Callable[[], int], collective: str,
                 nbytes: int = 0, result=None) -> None:
        """Number ``task`` and run it now if the line is empty, else queue it and wait for it."""
        with self._issue_lock:
            self.check_healthy()
            seq = next_seq()
            if self._in_flight == 0:
                self._in_flight = 1
                self._inline_busy = True
                work = None
            else:
                work = Work(collective, seq, nbytes, result)
                self._enqueue(task, seq, work)
        if work is not None:
            work.wait()
            return
        try:
            task(seq)
        except BaseException as exc:
            self._record_failure(exc)
            raise
        finally:
            with self._issue_lock:
                self._in_flight -= 1
                self._inline_busy = False

    def submit(self, task: NumberedTask, next_seq: Callable[[], int], collective: str,
               nbytes: int = 0, result=None) -> Work:
        """Number ``task`` and queue it for the communication thread; return its ``Work``."""
        with self._issue_lock:
            self.check_healthy()
            seq = next_seq()
            work = Work(collective, seq, nbytes, result)
            self._enqueue(task, seq, work)
        return work

    def _enqueue(self, task: NumberedTask, seq: int, work: Work) -> None:
        self._in_flight += 1
        with self._wakeup:
            self._queue.append((task, seq, work))
            self._wakeup.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"commlib-{self.name}", daemon=True)
            self._thread.start()

    # -- the communication thread --------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wakeup:
                while not self._queue:
                    if self._closed:
                        return
                    self._wakeup.wait()
                task, seq, work = self._queue.popleft()
            self._wait_for_inline_collective()
            error = None
            if self.first_error is not None:
                error = GroupAbortedError(
                    f"{self.name}: {work.collective} #{work.seq} not run: an earlier collective "
                    f"failed: {self.first_error}"
                )
            else:
                try:
                    task(seq)
                except BaseException as exc:  # surfaced through Work.wait()
                    error = exc
                    self._record_failure(exc)
            with self._issue_lock:
                self._in_flight -= 1
            work._complete(error)

    def _wait_for_inline_collective(self) -> None:
        """Rare: another thread queued work while a synchronous collective ran inline."""
        delay = 1e-6
        while self._inline_busy:
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _record_failure(self, exc: BaseException) -> None:
        if self.first_error is None and isinstance(exc, Exception):
            self.first_error = exc

    def pending(self) -> int:
        return self._in_flight

    def close(self) -> None:
        """Stop the comm thread after the queued collectives ran."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
