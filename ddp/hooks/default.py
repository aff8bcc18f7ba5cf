"""Communication hooks: how one bucket of gradients is reduced.

A hook is a :data:`CommHook`, ``hook(state, bucket: GradBucket) -> HookResult``: it starts the
reduction of ``bucket.buffer()`` (asynchronously) and returns a :class:`commlib.WorkHandle`
(``wait()``, ``is_completed()``, ``result()``, ``add_done_callback()``: a collective's ``Work``,
or a :class:`HookWork` that finishes in the caller's thread) or, as torch's hooks do, a
``torch.futures.Future`` whose value is the result; the result is the flat reduced buffer (a
tensor or a numpy/cupy array, the bucket's own memory or a new one of the same size). The reducer
waits on it at the end of backward and copies the result into the bucket if it is new memory.
``state`` is whatever was passed to ``register_comm_hook`` (``None`` for the default hook); the
built-in hooks accept a process group there.

The default hook averages: one ``allreduce(AVG)`` on the bucket's memory, on the group's
communication thread (CPU) or comm stream (GPU), no copy. The compression hooks halve the bytes on
the wire at the cost of precision: they divide by the world size *before* the reduction (an fp16
sum of P gradients can overflow where the average would not), reduce the 16-bit copy, and
decompress into the bucket when the result is asked for.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

from autograd_bridge.tensors import to_array
from commlib import ReduceOp, WorkHandle

from ddp.stats import ByteCounter, MeteredGroup

__all__ = ["GradBucket", "HookWork", "CompletedWork", "HookResult", "CommHook", "allreduce_hook",
           "fp16_compress_hook", "bf16_compress_hook"]


class GradBucket:
    """What a comm hook sees of one bucket (the names follow torch's ``dist.GradBucket``).

    Beyond torch: ``parameter_indices()`` (positions among the DDP model's trainable parameters,
    stable across bucket rebuilds and processes, so hook state can be keyed and checkpointed by
    them) and ``metered(group)`` (a group whose collectives count towards the bucket's
    ``bytes_sent`` in the step statistics; ``process_group`` is metered already).
    """

    __slots__ = ("_index", "_buffer", "_array", "_params", "_is_last", "process_group", "algorithm",
                 "_gradients", "_param_indices", "_counter")

    def __init__(self, index: int, buffer: torch.Tensor, array, params: List[torch.Tensor],
                 is_last: bool, process_group, algorithm: str, *, gradients=None,
                 param_indices: Optional[Sequence[int]] = None, counter: Optional[ByteCounter] = None):
        self._index = index
        self._buffer = buffer
        self._array = array
        self._params = params
        self._is_last = is_last
        self._counter = counter
        self.process_group = self.metered(process_group)
        self.algorithm = algorithm
        self._gradients = gradients
        self._param_indices = None if param_indices is None else tuple(param_indices)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient buffer (1-D tensor); reducing it in place is the cheapest result."""
        return self._buffer

    def array(self):
        """The same memory as a numpy (CPU) or cupy (CUDA) array, for commlib collectives."""
        return self._array

    def parameters(self) -> List[torch.Tensor]:
        return list(self._params)

    def gradients(self) -> List[torch.Tensor]:
        """Each parameter's gradient as a view of ``buffer()``, shaped like the parameter."""
        if self._gradients is None:
            views, offset = [], 0
            for param in self._params:
                views.append(self._buffer[offset:offset + param.numel()].view(param.shape))
                offset += param.numel()
            self._gradients = views
        return list(self._gradients)

    def parameter_indices(self) -> Tuple[int, ...]:
        """Positions of ``parameters()`` among the model's trainable parameters (default: 0, 1, ...)."""
        if self._param_indices is None:
            return tuple(range(len(self._params)))
        return self._param_indices

    def is_last(self) -> bool:
        return self._is_last

    def metered(self, group):
        """``group``, counting what is sent through it towards this bucket's ``bytes_sent``."""
        if self._counter is None or group is None or isinstance(group, MeteredGroup):
            return group
        return MeteredGroup(group, self._counter)

    def __repr__(self) -> str:
        return (f"<GradBucket {self._index}: {self._buffer.numel()} x {self._buffer.dtype}, "
                f"{len(self._params)} params>")


#: What a comm hook returns: one of our handles, or a torch future (torch-style hooks).
HookResult = Union[WorkHandle, torch.futures.Future]
#: ``hook(state, bucket) -> HookResult`` (``state``: what ``register_comm_hook`` was given).
CommHook = Callable[[Any, GradBucket], HookResult]


class HookWork:
    """A ``Work`` followed by a step (decompression) that runs in the thread that asks for the result."""

    __slots__ = ("work", "_then", "_value", "_finished", "keepalive")

    def __init__(self, work, then: Callable[[], object], keepalive=None):
        self.work = work
        self._then = then
        self._value: object = None
        self._finished = False
        self.keepalive = keepalive  # temporaries the collective reads or writes

    def wait(self, timeout: Optional[float] = None) -> bool:
        self.work.wait(timeout)
        if not self._finished:
            self._value = self._then()
            self._finished = True
            self.keepalive = None
        return True

    def result(self):
        self.wait()
        return self._value

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def add_done_callback(self, callback) -> None:
        self.work.add_done_callback(lambda _work: callback(self))


def _group(state, bucket: GradBucket):
    return bucket.metered(state) if state is not None else bucket.process_group


def allreduce_hook(state, bucket: GradBucket) -> WorkHandle:
    """Average the bucket in place across the group (the default)."""
    group = _group(state, bucket)
    return group.allreduce(bucket.array(), ReduceOp.AVG, algorithm=bucket.algorithm, async_op=True)


def _compress_hook(state, bucket: GradBucket, dtype: torch.dtype) -> WorkHandle:
    group = _group(state, bucket)
    buffer = bucket.buffer()
    # Divide before the reduction: a 16-bit sum of P gradients can overflow where their average fits.
    compressed = torch.mul(buffer, 1.0 / group.size).to(dtype)
    array = to_array(compressed)
    work = group.allreduce(array, ReduceOp.SUM, algorithm=bucket.algorithm, async_op=True)

    def decompress():
        buffer.copy_(compressed)
        return buffer

    return HookWork(work, decompress, keepalive=compressed)


def fp16_compress_hook(state, bucket: GradBucket) -> WorkHandle:
    """Reduce a float16 copy of the bucket (half the bytes), then decompress into the bucket."""
    return _compress_hook(state, bucket, torch.float16)


def bf16_compress_hook(state, bucket: GradBucket) -> WorkHandle:
    """Like ``fp16_compress_hook`` with bfloat16: fp32's range, fewer mantissa bits."""
    return _compress_hook(state, bucket, torch.bfloat16)


class CompletedWork:
    """The handle of a reduction that needed no communication (a local step): done at once."""

    __slots__ = ("_value",)

    def __init__(self, value):
        self._value = value

    def wait(self, timeout: Optional[float] = None) -> bool:
        return True

    def result(self):
        return self._value

    def is_completed(self) -> bool:
        return True

    def add_done_callback(self, callback) -> None:
        callback(self)
