"""torch tensors <-> numpy / cupy arrays, without copies.

The only module in the project that converts between the two worlds. CPU tensors share memory
with numpy through ``Tensor.numpy()``; CUDA tensors with cupy through DLPack. bfloat16 has no
numpy dtype of its own: it is viewed as ``ml_dtypes.bfloat16`` (same bits) when that package is
installed (a dependency of the ``torch`` extra); code that only moves bytes views it as int16
and needs no package.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["to_array", "from_array", "is_cuda", "symmetric_zeros", "bfloat16_numpy_dtype"]


def bfloat16_numpy_dtype():
    """numpy's bfloat16 (``ml_dtypes.bfloat16``), or None where ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def _bfloat16_dtype():
    dtype = bfloat16_numpy_dtype()
    if dtype is None:
        raise TypeError("bfloat16 arrays need the ml_dtypes package (pip install ml_dtypes, or the "
                        "commlib-ddp[torch] extra)")
    return dtype


def is_cuda(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def to_array(tensor: torch.Tensor):
    """A numpy (CPU) or cupy (CUDA) array sharing ``tensor``'s memory. Needs a contiguous tensor."""
    if not tensor.is_contiguous():
        raise ValueError(
            f"to_array: tensor of shape {tuple(tensor.shape)} with strides {tensor.stride()} is not "
            f"contiguous; expected a contiguous tensor (call .contiguous() first)"
        )
    if tensor.device.type == "cuda":
        import cupy

        if tensor.dtype == torch.bool:
            raise TypeError("to_array: bool tensors are not supported by commlib collectives")
        return cupy.from_dlpack(tensor.detach())
    if tensor.device.type != "cpu":
        raise TypeError(f"to_array: tensors on {tensor.device} are not supported; expected cpu or cuda")
    detached = tensor.detach()
    if detached.dtype == torch.bfloat16:
        return detached.view(torch.int16).numpy().view(_bfloat16_dtype())
    return detached.numpy()


def from_array(array) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (numpy -> CPU tensor, cupy -> CUDA tensor)."""
    if isinstance(array, np.ndarray):
        if array.dtype.name == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def symmetric_zeros(group, numel: int, dtype: torch.dtype, device) -> "torch.Tensor | None":
    """A zeroed 1-D tensor over a symmetric buffer of ``group`` (``group.alloc``), or None where that
    would not make its allreduce faster (a GPU tensor, a group without one-host shared memory).

    Collective when it allocates: every rank calls it in the same order with the same arguments.
    """
    if torch.device(device).type != "cpu" or not getattr(group, "prefers_symmetric_buffers", False):
        return None
    if dtype == torch.bfloat16:
        np_dtype = _bfloat16_dtype()
    else:
        try:
            np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:  # no numpy counterpart (complex32, ...): an ordinary tensor
            return None
    array = group.alloc((numel,), np_dtype)
    array[...] = 0
    return from_array(array)
