"""Communication hooks: how one bucket of gradients is reduced.

A hook is ``hook(state, bucket: GradBucket) -> work``: it starts the reduction of
``bucket.buffer()`` (asynchronously) and returns a handle with ``wait()`` and ``result()``; the
result is the flat reduced buffer (a tensor or a numpy/cupy array, the bucket's own memory or a
new one of the same size). The reducer waits on it at the end of backward and copies the result
into the bucket if it is new memory. ``state`` is whatever was passed to ``register_comm_hook``
(``None`` for the default hook); the built-in hooks accept a process group there.

The default hook averages: one ``allreduce(AVG)`` on the bucket's memory, on the group's
communication thread (CPU) or comm stream (GPU), no copy. The compression hooks halve the bytes on
the wire at the cost of precision: they divide by the world size *before* the reduction (an fp16
sum of P gradients can overflow where the average would not), reduce the 16-bit copy, and
decompress into the bucket when the result is asked for.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch

from autograd_bridge.tensors import to_array
from commlib import ReduceOp

__all__ = ["GradBucket", "HookWork", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook"]


class GradBucket:
    """What a comm hook sees of one bucket (the names follow torch's ``dist.GradBucket``)."""

    __slots__ = ("_index", "_buffer", "_array", "_params", "_is_last", "process_group", "algorithm")

    def __init__(self, index: int, buffer: torch.Tensor, array, params: List[torch.Tensor],
                 is_last: bool, process_group, algorithm: str):
        self._index = index
        self._buffer = buffer
        self._array = array
        self._params = params
        self._is_last = is_last
        self.process_group = process_group
        self.algorithm = algorithm

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

    def is_last(self) -> bool:
        return self._is_last

    def __repr__(self) -> str:
        return (f"<GradBucket {self._index}: {self._buffer.numel()} x {self._buffer.dtype}, "
                f"{len(self._params)} params>")


class HookWork:
    """A ``Work`` followed by a step (decompression) that runs in the thread that asks for the result."""

    __slots__ = ("work", "_then", "_value", "_finished", "keepalive")

    def __init__(self, work, then: Callable[[], object], keepalive=None):
        self.work = work
        self._then = then
        self._value = None
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
    return state if state is not None else bucket.process_group


def allreduce_hook(state, bucket: GradBucket):
    """Average the bucket in place across the group (the default)."""
    group = _group(state, bucket)
    return group.allreduce(bucket.array(), ReduceOp.AVG, algorithm=bucket.algorithm, async_op=True)


def _compress_hook(state, bucket: GradBucket, dtype: torch.dtype):
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


def fp16_compress_hook(state, bucket: GradBucket):
    """Reduce a float16 copy of the bucket (half the bytes), then decompress into the bucket."""
    return _compress_hook(state, bucket, torch.float16)


def bf16_compress_hook(state, bucket: GradBucket):
    """Like ``fp16_compress_hook`` with bfloat16: fp32's range, fewer mantissa bits."""
    return _compress_hook(state, bucket, torch.bfloat16)
