"""One order for a group's collectives, the same on every rank, whatever thread issues them.

Collectives are matched across ranks by position: the n-th collective a rank runs on a group
meets the n-th of every other rank (its sequence number, its message tags and, in debug mode,
its fingerprint all derive from n). So the order must depend on the program alone, never on
timing. The rules:

1. **Issue order.** Collectives issued by user threads run in the order they were issued (under
   one lock). Every rank must issue the same collectives in the same order, as in MPI; from
   several user threads at once that is the program's job.
2. **Ordered callbacks.** A callback added with ``Work.add_done_callback`` (and the torch backend's
   futures, which are completed by one) runs on the group's *communication thread*, at the place
   in the issue order where it was added: added right after issuing ``W``, it runs right after
   ``W`` completed and before the next collective starts, however early or late ``W`` completed.
3. **Nested collectives.** A collective issued from the communication thread (from a callback)
   runs at once, right there, before anything queued; an ``async_op`` one returns a completed
   ``Work``. So a callback may issue collectives and wait for them (PowerSGD's hook does), and
   their place in the order is fixed by rule 2.

Sequence numbers are assigned when a collective *starts*, by the executor (``seq`` counts them),
so they follow this order. A callback
that waits for a collective queued after it would wait forever: ``Work.wait`` raises
``InvalidUsageError`` instead.

How it runs: a synchronous collective issued while nothing is queued runs right in the caller's
thread (a thread hop costs tens of microseconds, more than a whole small ``MPI_Allreduce``);
everything else goes through one FIFO of entries (collectives and callbacks) that the
communication thread works off. While an inline collective runs (``_inline_busy``), the comm
thread holds back what other threads queued meanwhile, so the two never overlap.
:meth:`CommExecutor.inline_runner` is the leanest form of the same rule, for the small-message
fast paths: its runner runs the collective under the issue lock itself, so nobody can queue
behind it and no bookkeeping is needed; it declines (returns False) whenever anything is in line.

After any collective (or callback) fails, the group is poisoned: queued and later collectives
fail at once with :class:`GroupAbortedError` naming the first error, because peers may now be
out of step.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from typing import Callable, NamedTuple, Optional

from commlib.errors import CommError, GroupAbortedError
from commlib.execution.work import Work

__all__ = ["CommExecutor"]

NumberedTask = Callable[[int], None]


class _Entry(NamedTuple):
    """A queued collective (``task`` set) or an ordered callback (``callback`` set)."""

    task: Optional[NumberedTask]
    work: Work
    callback: Optional[Callable[[Work], None]] = None


class CommExecutor:
    def __init__(self, name: str):
        self.name = name
        self._issue_lock = threading.Lock()
        self._inline_busy = False
        self._queue: "collections.deque[_Entry]" = collections.deque()
        self._wakeup = threading.Condition(threading.Lock())
        self._in_flight = 0  # queued entries not finished, plus an inline collective
        self._thread: Optional[threading.Thread] = None
        self._thread_ident: Optional[int] = None
        self._closed = False
        self.first_error: Optional[BaseException] = None
        self.seq = 0  # collectives started so far; the n-th gets number n
        self._numbered_elsewhere = 0  # of them, those not run by an inline runner

    def _next_seq(self) -> int:
        # Under the issue lock, or on the comm thread while no inline collective can run (see
        # _run_queued): never two at once.
        self.seq += 1
        self._numbered_elsewhere += 1
        return self.seq

    # -- issuing -------------------------------------------------------------------------------
    def check_healthy(self) -> None:
        if self.first_error is not None:
            raise GroupAbortedError(
                f"{self.name}: unusable after an earlier error: {self.first_error}"
            ) from self.first_error
        if self._closed:
            raise GroupAbortedError(f"{self.name}: the group was closed")

    def on_comm_thread(self) -> bool:
        return self._thread_ident is not None and threading.get_ident() == self._thread_ident

    def run_sync(self, task: NumberedTask, collective: str,
                 nbytes: int = 0, result=None) -> None:
        """Run ``task`` now if the line is empty (or from a callback), else queue it and wait."""
        if self.on_comm_thread():
            self.check_healthy()
            self._run_numbered(task)
            return
        with self._issue_lock:
            self.check_healthy()
            if self._in_flight == 0:
                self._in_flight = 1
                self._inline_busy = True
                seq = self._next_seq()
                work = None
            else:
                work = Work(collective, None, nbytes, result, executor=self)
                self._enqueue(_Entry(task, work))
        if work is not None:
            work.wait()
            return
        try:
            task(seq)
        except BaseException as exc:
            self.record_failure(exc)
            raise
        finally:
            with self._issue_lock:
                self._in_flight -= 1
                self._inline_busy = False

    def inline_runner(self, run: Callable[..., bool], limit: float) -> Callable[..., bool]:
        """``runner(a, b, c)``: ``run(seq, limit, a, b, c)`` now, in the caller's thread, if
        nothing is in line.

        For collectives that take microseconds (the small-message fast paths): up to three
        arguments, unused ones None (a fixed signature: forwarding ``*args`` costs 75 ns, a
        twentieth of the budget), and ``limit``, the largest message ``run`` may take for the
        algorithm this runner stands for (one runner per algorithm that has a fast path, so
        the caller picks by algorithm in one lookup). ``runner`` takes the issue lock, declines (False)
        when anything is queued or running, when the group is poisoned or closed, and on the
        communication thread (a callback's collective has its place there; the running entry
        keeps the line busy); else numbers the collective and calls ``run``, which either runs
        it (True) or declines before touching anything (False: the number is given back;
        nobody else can have taken one, the lock is held). The lock is held for the whole call,
        so nothing can queue behind it (a thread issuing meanwhile waits for the lock, then
        finds the line empty again) and no in-flight bookkeeping is needed. A failing ``run``
        poisons the group as a queued collective does. The caller takes the general path,
        which orders, numbers and explains, whenever it gets False.
        """
        # One closure per fast path, its state in locals. Plain acquire/release: a ``with``
        # block costs twice as much.
        issue_lock = self._issue_lock

        def runner(a=None, b=None, c=None) -> bool:
            issue_lock.acquire()
            try:
                if self._in_flight or self.first_error is not None or self._closed:
                    return False
                self.seq = seq = self.seq + 1
                if run(seq, limit, a, b, c):
                    return True
                self.seq = seq - 1
                return False
            except BaseException as exc:
                self.record_failure(exc)
                raise
            finally:
                issue_lock.release()

        return runner

    @property
    def inline_runs(self) -> int:
        """How many collectives an inline runner ran (to see the fast path taken)."""
        return self.seq - self._numbered_elsewhere

    def submit(self, task: NumberedTask, collective: str,
               nbytes: int = 0, result=None) -> Work:
        """Queue ``task`` for the communication thread and return its ``Work`` (from a callback:
        run it now and return it completed)."""
        work = Work(collective, None, nbytes, result, executor=self)
        if self.on_comm_thread():
            self.check_healthy()
            error = None
            try:
                work.seq = self._run_numbered(task)
            except BaseException as exc:  # noqa: BLE001 - surfaced through Work.wait(), as for a queued one
                error = exc
            work.complete(error)
            return work
        with self._issue_lock:
            self.check_healthy()
            self._enqueue(_Entry(task, work))
        return work

    def add_callback(self, target: Work, callback: Callable[[Work], None], *, after: Work) -> None:
        """Run ``callback(target)`` at this point of the issue order (see the module's rule 2).

        ``after`` is the executor's own work for the collective (``target`` itself, or the
        enqueue of a GPU collective)."""
        if self.on_comm_thread():
            if after.has_run():
                self._invoke_callback(target, callback)
            else:  # queued behind the running entry: run right after it, before what follows it
                after.when_complete(lambda _work: self._invoke_callback(target, callback))
            return
        with self._issue_lock:
            closed = self._closed
            if not closed:
                self._enqueue(_Entry(None, target, callback))
        if closed:  # the group is gone: no order left to keep
            target.when_complete(callback)

    def _enqueue(self, entry: _Entry) -> None:
        self._in_flight += 1
        with self._wakeup:
            self._queue.append(entry)
            self._wakeup.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"commlib-{self.name}", daemon=True)
            self._thread.start()

    def _run_numbered(self, task: NumberedTask) -> int:
        seq = self._next_seq()  # on the comm thread: see _run_queued
        try:
            task(seq)
        except BaseException as exc:
            self.record_failure(exc)
            raise
        return seq

    # -- the communication thread --------------------------------------------------------------
    def _loop(self) -> None:
        self._thread_ident = threading.get_ident()
        while True:
            with self._wakeup:
                while not self._queue:
                    if self._closed:
                        return
                    self._wakeup.wait()
                entry = self._queue.popleft()
            self._wait_for_inline_collective()
            if entry.callback is not None:
                self._invoke_callback(entry.work, entry.callback)
            else:
                self._run_queued(entry)
            with self._issue_lock:
                self._in_flight -= 1

    def _run_queued(self, entry: _Entry) -> None:
        work = entry.work
        assert entry.task is not None  # a collective, not a callback
        # No lock: besides this thread only an inline collective numbers (with _in_flight == 0,
        # so never while an entry is being worked off; _wait_for_inline_collective saw it end).
        work.seq = self._next_seq()
        error: Optional[BaseException] = None
        if self.first_error is not None:
            error = GroupAbortedError(
                f"{self.name}: {work.collective} #{work.seq} not run: an earlier collective "
                f"failed: {self.first_error}"
            )
        else:
            try:
                entry.task(work.seq)
            except BaseException as exc:  # noqa: BLE001 - surfaced through Work.wait()
                error = exc
                self.record_failure(exc)
        work.complete(error)  # runs the callbacks added on this thread, right here

    def _invoke_callback(self, target: Work, callback: Callable[[Work], None]) -> None:
        try:
            target.settle()
            callback(target)
        except Exception as exc:  # noqa: BLE001 - reported and poisons the group
            # The callback may have skipped collectives its peers issue: this rank may now be out
            # of step, so later collectives must fail rather than pair with the wrong ones.
            sys.stderr.write(f"commlib: {self.name}: a done-callback of {target.label()} raised "
                             f"{type(exc).__name__}: {exc}; the group is unusable from here on\n"
                             + "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
            sys.stderr.flush()
            self.record_failure(CommError(
                f"a done-callback of {target.label()} raised {type(exc).__name__}: {exc}"))

    def _wait_for_inline_collective(self) -> None:
        """Rare: another thread queued work while a synchronous collective ran inline."""
        delay = 1e-6
        while self._inline_busy:
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def record_failure(self, exc: BaseException) -> None:
        """Poison the group: later collectives fail at once naming ``exc`` (the first one kept)."""
        if self.first_error is None and isinstance(exc, Exception):
            self.first_error = exc

    def pending(self) -> int:
        return self._in_flight

    def close(self) -> None:
        """Stop the comm thread after the queued collectives and callbacks ran."""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
