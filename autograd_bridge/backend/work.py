"""How the "commlib" torch backend turns a commlib collective into a torch ``Work``.

A sync call (``opts.asyncOp`` False, as ``dist.all_reduce(t)`` passes) runs through commlib's
synchronous path (inline when the line is empty: the small-allreduce fast path) and returns an
already completed Work, so the Future machinery costs nothing on the hot path. An async call
returns a Work over a :class:`CommlibFuture`, completed by an *ordered* done-callback of the
commlib collective (see :mod:`commlib.execution.executor`): on the group's communication thread, right
after the collective, before the next one starts. torch runs a future's callbacks on the thread
that completes it, so a comm hook's callback that issues collectives (PowerSGD's does, and waits
for them) issues them there, nested, at the same point of the order on every rank; and
``CommlibFuture.then`` is ordered the same way when it is attached after the future completed.
With torch's gloo backend the same hook races the next bucket's launch (measured: it hangs);
here the ranks cannot diverge.

A small async call (at most :data:`EAGER_BYTES`) issued while the group has nothing in flight
runs at once in the caller's thread, as a sync call does, and returns a completed Work: a
thread hop costs more than such a collective (DTensor's and the functional collectives' calls
are async and waited at once). Its future is a :class:`CommlibFuture` over the group's *anchor*
(a barrier issued when the group was made), so a callback attached to it still runs as rule 2
of :mod:`commlib.execution.executor` says: on the communication thread, at the place in the
issue order where it was attached, exactly as for a collective that completed before the
callback was attached.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Optional

import torch.distributed as dist
from torch.futures import Future

import commlib
from commlib import InvalidUsageError

from autograd_bridge.cuda_streams import on_torch_stream

__all__ = ["FutureWork", "CommlibFuture", "Completer", "Tracked", "done_work", "EAGER_BYTES"]

EAGER_BYTES = 64 << 10


class CommlibFuture(Future):
    """A torch Future of a commlib collective whose callbacks keep the group's order.

    ``then`` and ``add_done_callback`` run their callback as commlib's ordered done-callbacks do
    (on the communication thread, at the place of the issue order where they were attached), and
    ``wait`` called on the communication thread for a collective queued behind the caller raises
    ``InvalidUsageError`` instead of deadlocking.
    """

    def __init__(self, work: "commlib.Work"):
        super().__init__()
        self.commlib_work = work

    def wait(self):
        if not self.done():
            self.commlib_work.check_wait_allowed()
        return super().wait()

    def then(self, callback):
        chained: Future[Any] = Future()

        def run(_work):
            try:
                chained.set_result(callback(self))
            except Exception as exc:  # noqa: BLE001 - torch's then hands it to the chained future
                chained.set_exception(exc)

        self.commlib_work.add_done_callback(run)
        return chained

    def add_done_callback(self, callback) -> None:
        self.commlib_work.add_done_callback(lambda _work: callback(self))


class FutureWork(dist._Work):
    """A torch Work over a torch Future (completed by the backend).

    Not ``_create_work_from_future``: its ``wait()`` returns True even when the future holds an
    error, and an async collective that failed would look like a success.
    """

    def __init__(self, future: Future):
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.wait()  # re-raises the collective's error
        return True

    def get_future(self) -> Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - the answer is "no"
            return False
        return True

    def result(self):
        return self._future.wait()

    def synchronize(self) -> None:
        self.wait()


def done_work() -> FutureWork:
    future: Future[list] = Future()
    future.set_result([])
    return FutureWork(future)


class Completer:
    """Turns commlib calls into torch Works (sync: the shared completed one; async: a FutureWork).

    Collective where it is made (the anchor is a barrier of ``group``): every rank makes the
    group's Completer at the same point, as torch makes groups."""

    def __init__(self, group: "commlib.ProcessGroup"):
        self.done = done_work()
        self._executor = group.executor
        self._anchor = group.barrier(async_op=True)
        self._tracked = threading.local()

    def tracking(self) -> bool:
        """Whether this thread is inside :meth:`track`."""
        return getattr(self._tracked, "call", None) is not None

    @contextlib.contextmanager
    def track(self) -> Iterator["Tracked"]:
        """Within: every call this thread completes is queued (never eager, never inline) and the
        last commlib work is kept, with whether the caller asked for a sync call (what the
        profiler's record of a call waits for: :mod:`.profiling`)."""
        tracked = Tracked()
        self._tracked.call = tracked
        try:
            yield tracked
        finally:
            self._tracked.call = None

    def complete(self, opts, issue, result, finish=None, device=None, nbytes=None):
        """Run ``issue(async_op)`` (a commlib call); return a torch Work completed after it.

        ``device``: the CUDA device of the tensors (None on CPU); the call is then issued with
        torch's current stream made CuPy's current stream, which commlib's GPU backend orders
        its comm stream after (and, for a sync call, makes wait for the result). ``nbytes``:
        the call's size, where an async call of at most EAGER_BYTES may run at once (None:
        never).
        """
        if device is not None:
            with on_torch_stream(device):
                return self.complete(opts, issue, result, finish)
        tracked = getattr(self._tracked, "call", None)
        if tracked is not None:
            return self._queued(issue, result, finish, tracked, sync=opts is not None and not opts.asyncOp)
        if opts is not None and not opts.asyncOp:
            issue(False)
            if finish is not None:
                finish()
            return self.done
        if nbytes is not None and nbytes <= EAGER_BYTES and not self._executor.pending():
            return self._eager(issue, result, finish)
        return self._queued(issue, result, finish)

    def _queued(self, issue, result, finish, tracked: Optional["Tracked"] = None, sync: bool = False) -> FutureWork:
        work = issue(True)
        future = CommlibFuture(work)
        work.add_done_callback(lambda w: _deliver(future, w, finish, result))
        if tracked is not None:
            tracked.last, tracked.sync = work, tracked.sync or sync
        return FutureWork(future)

    def _eager(self, issue, result, finish) -> FutureWork:
        future = CommlibFuture(self._anchor)
        try:
            issue(False)  # (if the line filled meanwhile, this queues and waits: still in order)
            if finish is not None:
                finish()
        except InvalidUsageError:
            raise  # refused before sending, as for a sync call
        except Exception as exc:  # noqa: BLE001 - an async call's error surfaces in wait()
            future.set_exception(exc)
            return FutureWork(future)
        future.set_result(result)
        return FutureWork(future)


class Tracked:
    """What :meth:`Completer.track` saw: the last commlib work issued, and whether a sync call was made."""

    def __init__(self):
        self.last: Optional["commlib.Work"] = None
        self.sync = False


def _deliver(future: Future, work, finish, result) -> None:
    error = work.exception()
    # (A GPU work's ordered callback runs once the GPU finished: waiters see the data.)
    if error is None and finish is not None:
        try:
            finish()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            error = exc
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
