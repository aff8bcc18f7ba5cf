"""Tensors as the arrays commlib takes: views where possible, copies that are copied back.

commlib takes C-contiguous numpy (or cupy) arrays of MPI-representable dtypes. A contiguous
tensor is viewed in place (``tensors.to_array``, zero-copy); a non-contiguous one goes through a
contiguous copy that a *finisher* copies back after the collective; bool is sent as its bytes
(uint8) and complex as pairs of reals. bfloat16 moves as its bits (int16: no package needed);
where it is reduced it is numpy's bfloat16 from ml_dtypes (the ``torch`` extra installs it, and
every element is rounded as torch rounds), else a float32 copy reduced by commlib and rounded
once by torch on the way back. A dtype numpy does not know (float8, ...) moves as its bytes.
"""

from __future__ import annotations

import torch

from commlib import InvalidUsageError

from autograd_bridge.tensors import bfloat16_numpy_dtype, to_array

__all__ = ["Staged", "NUMPY_DTYPES", "copy_back_all", "chain", "single"]

# Dtypes whose ``Tensor.numpy()`` is already an array commlib takes (no bool, complex or
# bfloat16): the backend's allreduce fast path views these without staging.
NUMPY_DTYPES = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.int16,
                          torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64})
_HAS_NUMPY_BFLOAT16 = bfloat16_numpy_dtype() is not None


class Staged:
    """An array view of a tensor; for a non-contiguous or bool tensor, a copy that is copied back."""

    __slots__ = ("tensor", "array", "copy", "cuda_device")

    def __init__(self, tensor: torch.Tensor, what: str, *, reduces: bool = False):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"commlib backend: {what} must be a torch.Tensor, got {type(tensor).__name__}")
        self.tensor = tensor
        self.cuda_device = tensor.device if tensor.is_cuda else None
        self.copy = None if tensor.is_contiguous() else tensor.contiguous()
        source = tensor if self.copy is None else self.copy
        dtype = source.dtype
        if dtype in NUMPY_DTYPES:
            pass
        elif dtype is torch.bool:  # numpy's bool is no MPI type; same bytes as uint8
            source = source.view(torch.uint8)
        elif source.is_complex():
            source = torch.view_as_real(source)
        elif dtype is torch.bfloat16:
            if not reduces:
                source = source.reshape(-1).view(torch.int16)
            elif not _HAS_NUMPY_BFLOAT16 and self.cuda_device is None:
                self.copy = source = source.float()
        else:
            source = source.reshape(-1).view(torch.uint8)
        self.array = to_array(source)

    def copy_back(self) -> None:
        if self.copy is not None:
            self.tensor.copy_(self.copy)


def copy_back_all(staged):
    """A finisher that copies the staged copies back into their tensors, or None if none needs it."""
    needing = [s for s in staged if s.copy is not None]
    if not needing:
        return None

    def finish():
        for s in needing:
            s.copy_back()

    return finish


def chain(finishers):
    """One finisher running ``finishers`` in order, or None for none."""
    if not finishers:
        return None
    if len(finishers) == 1:
        return finishers[0]

    def run_all():
        for fn in finishers:
            fn()

    return run_all


def single(tensors, collective: str):
    """The one tensor of a call (torch passes lists, one entry per device of the process)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    if len(tensors) != 1:
        raise InvalidUsageError(
            f"commlib backend: {collective} takes exactly one tensor per call (one device per "
            f"process), got {len(tensors)}"
        )
    return tensors[0]
