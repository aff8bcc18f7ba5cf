"""What torch's profiler sees of a "commlib" collective: one async event per call, as gloo's.

torch's own backends record every collective as a ``RecordFunction`` named
``<backend>:<collective>`` (``gloo:all_reduce``), with the call's input tensors (the event's
``input_shapes``), opened when the call is made and closed when the collective completes (on
the backend's worker thread), marked async (``RecordFunction::_setAsync``, which Python cannot
reach: the profiler also counts an event as async when it ends on another thread than it
began). DDP's profiling, and torch's distributed suite, look for exactly that: one event per
call, async, with the inputs' shapes.

While a profiler runs, a method decorated with :func:`profiled` is such a call: the event opens
before anything is issued; every collective the call issues takes the queued path (on the
communication thread, as a gloo work on its worker; the eager and sync shortcuts would finish
in the caller's thread), and the event closes in an ordered done-callback of the last of them,
on the communication thread, before the caller's Work completes (so a ``wait()`` inside the
profiler's block always sees the closed event). A sync call waits for that, then returns.
Calls nested in a profiled call (``allgather_coalesced`` runs ``allgather`` per tensor) are
part of its one event. Without a profiler the decorator costs one flag test.

Point-to-point (:func:`profiled_p2p`: ``commlib:send``, ``commlib:recv``,
``commlib:recvAnySource``, gloo's names): the event closes when commlib's work completes, on the
thread that completes it (the point-to-point engine's), and the torch Work's ``wait()`` returns
once it closed; a work that completed in the caller's own thread (a small send the kernel took
at once) has its event closed by a closing thread, so that it still ends on another thread.
"""

from __future__ import annotations

import functools
import os
import queue
import threading
from typing import Any, Callable, List, Optional, Tuple, TypeVar, cast

import torch
from torch.autograd import profiler as autograd_profiler
from torch.futures import Future

from autograd_bridge.backend.work import CommlibFuture, FutureWork

__all__ = ["profiled", "profiled_p2p", "profiler_running", "tensors_of"]

Method = TypeVar("Method", bound=Callable[..., Any])


def profiler_running() -> bool:
    """Whether a torch profiler is recording (torch's own fast flag, set by both profilers)."""
    return autograd_profiler._is_profiler_enabled


def tensors_of(value) -> List[torch.Tensor]:
    """The tensors of an argument torch hands a backend: a tensor, a list, or a list of lists."""
    if isinstance(value, torch.Tensor):
        return [value]
    found: List[torch.Tensor] = []
    for item in value or ():
        found.extend(tensors_of(item))
    return found


def profiled(collective: str, inputs: Callable[..., List[torch.Tensor]]) -> Callable[[Method], Method]:
    """Decorate a torch-facing method of the group: recorded as ``commlib:<collective>`` with
    ``inputs(*args, **kwargs)`` (the call's input tensors) while a profiler runs."""
    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            completer = self._completer
            if not autograd_profiler._is_profiler_enabled or completer.tracking():
                return method(self, *args, **kwargs)
            title = f"{self.getBackendName()}:{collective}"
            record = torch._C._autograd._record_function_with_args_enter(title, *inputs(*args, **kwargs))
            try:
                with completer.track() as tracked:
                    work = method(self, *args, **kwargs)
            except BaseException:
                torch._C._autograd._record_function_with_args_exit(record)
                raise
            if tracked.last is None:  # nothing was issued (no tensors): nothing to wait for
                torch._C._autograd._record_function_with_args_exit(record)
                return work
            ended = CommlibFuture(tracked.last)
            source = work.get_future()

            def close(_work) -> None:
                # Ordered after the delivery of the call's own future (attached before this).
                torch._C._autograd._record_function_with_args_exit(record)
                _pass_on(source, ended)

            tracked.last.add_done_callback(close)
            if tracked.sync:
                ended.wait()  # re-raises the collective's error
                return completer.done
            return FutureWork(ended)

        return cast(Method, call)

    return decorate


def profiled_p2p(operation: str) -> Callable[[Method], Method]:
    """Decorate ``send(tensors, dst, tag)`` / ``recv(tensors, src, tag)`` / ``recv_anysource(tensors, tag)``
    (returning a :class:`.exchange.P2PTorchWork`): recorded as ``commlib:<operation>`` with the tensors."""
    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def call(self, tensors, *args, **kwargs):
            if not autograd_profiler._is_profiler_enabled:
                return method(self, tensors, *args, **kwargs)
            title = f"{self.getBackendName()}:{operation}"
            record = torch._C._autograd._record_function_with_args_enter(title, *tensors_of(tensors))
            try:
                work = method(self, tensors, *args, **kwargs)
            except BaseException:
                torch._C._autograd._record_function_with_args_exit(record)
                raise
            closed = threading.Event()
            opener = threading.get_ident()

            def close(_work) -> None:
                if threading.get_ident() == opener:
                    _CLOSER.close(record, closed)
                else:
                    torch._C._autograd._record_function_with_args_exit(record)
                    closed.set()

            work.commlib_work.add_done_callback(close)
            work.hold_wait_until(closed)
            return work

        return cast(Method, call)

    return decorate


class _ClosingThread:
    """Closes records handed to it on a thread of its own (started on first use; a forked child,
    which inherits the queue but not the thread, starts its own)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._started: Optional[Tuple[int, queue.SimpleQueue]] = None

    def close(self, record, closed: threading.Event) -> None:
        with self._lock:
            if self._started is None or self._started[0] != os.getpid():
                pending: queue.SimpleQueue = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(pending,), name="commlib-profiler-close", daemon=True).start()
                self._started = (os.getpid(), pending)
            self._started[1].put((record, closed))

    @staticmethod
    def _run(pending: queue.SimpleQueue) -> None:
        while True:
            record, closed = pending.get()
            torch._C._autograd._record_function_with_args_exit(record)
            closed.set()


_CLOSER = _ClosingThread()


def _pass_on(source: Future, target: Future) -> None:
    try:
        target.set_result(source.value())
    except Exception as exc:  # noqa: BLE001 - the collective's error, for the waiter
        target.set_exception(exc)
