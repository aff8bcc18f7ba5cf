"""How the "commlib" torch backend turns a commlib collective into a torch ``Work``.

A sync call (``opts.asyncOp`` False, as ``dist.all_reduce(t)`` passes) runs through commlib's
synchronous path (inline when the line is empty: the small-allreduce fast path) and returns an
already completed Work, so the Future machinery costs nothing on the hot path. An async call
returns a Work over a ``torch.futures.Future`` completed by the group's *completion thread*, not
by commlib's communication thread: torch runs a future's callbacks on the thread that completes
it, and a comm hook's callback that issues a collective and waits for it (PowerSGD does) would
otherwise block the very thread that has to run that collective. Futures of collectives issued
*from* the completion thread are completed on the communication thread.
"""

from __future__ import annotations

import queue
import threading

import torch.distributed as dist
from torch.futures import Future

import commlib

from .cuda_streams import on_torch_stream

__all__ = ["FutureWork", "Completer", "done_work"]


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
    future = Future()
    future.set_result([])
    return FutureWork(future)


class Completer:
    """One daemon thread that completes torch futures (and so runs their callbacks)."""

    def __init__(self, name: str):
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()
        self.done = done_work()

    def complete(self, opts, issue, result, finish=None, device=None):
        """Run ``issue(async_op)`` (a commlib call); return a torch Work completed after it.

        ``device``: the CUDA device of the tensors (None on CPU); the call is then issued with
        torch's current stream made CuPy's current stream, which commlib's GPU backend orders
        its comm stream after (and, for a sync call, makes wait for the result).
        """
        if device is not None:
            with on_torch_stream(device):
                return self.complete(opts, issue, result, finish)
        if opts is not None and not opts.asyncOp:
            issue(False)
            if finish is not None:
                finish()
            return self.done
        future = Future()
        work = issue(True)
        if threading.current_thread() is self.thread:
            work.add_done_callback(lambda w: _deliver(future, w, finish, result))
        else:
            put = self._queue.put
            work.add_done_callback(lambda w: put((future, w, finish, result)))
        return FutureWork(future)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            _deliver(*item)

    def close(self) -> None:
        self._queue.put(None)


def _deliver(future: Future, work, finish, result) -> None:
    error = work.exception()
    if error is None and work.__class__ is not commlib.Work:
        # A GPU work completes when enqueued; a torch future has no stream semantics here, so
        # its waiters must see the data: block this (completion) thread until the GPU is done.
        try:
            work.synchronize()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            error = exc
    if error is None and finish is not None:
        try:
            finish()
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            error = exc
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
