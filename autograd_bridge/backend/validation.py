"""What the "commlib" backend can move: checked in the caller's thread, before anything is sent.

The backend serves dense (strided) tensors on the CPU, and on CUDA where commlib's GPU path
exists (CuPy installed); sparse COO tensors in allreduce (:mod:`.sparse`). Any dtype with a
fixed element size moves (as its bytes where numpy has no such type); quantized tensors do not.
A refusal is an ``InvalidUsageError`` naming the collective (and op), the dtype, the device and
the layout, so every rank that made the same call raises the same error and no buffer was
touched. Which op a dtype can be *reduced* with is :func:`.reduce_ops.plan_reduction`'s.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from commlib import InvalidUsageError

__all__ = ["check_served", "describe"]

@functools.lru_cache(maxsize=None)
def _has_cupy() -> bool:
    return importlib.util.find_spec("cupy") is not None


def describe(tensor: torch.Tensor) -> str:
    layout = "" if tensor.layout is torch.strided else f" {str(tensor.layout).replace('torch.', '')}"
    return f"a{layout} {tensor.dtype} tensor on {tensor.device}"


def check_served(collective: str, tensor, what: str = "tensor", *, sparse_ok: bool = False) -> None:
    """Raise unless the backend can run ``collective`` on ``tensor`` (see the module docstring)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"commlib backend: {collective}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    device = tensor.device.type
    if device != "cpu" and not (device == "cuda" and _has_cupy()):
        served = "cpu tensors (and cuda tensors where CuPy is installed)"
        raise InvalidUsageError(f"commlib backend: {collective} of {describe(tensor)} is not supported: the backend "
                                f"serves {served}; expected {what} on cpu")
    if tensor.layout is not torch.strided and not (sparse_ok and tensor.layout is torch.sparse_coo):
        expected = "a dense or sparse COO tensor" if sparse_ok else "a dense (strided) tensor"
        raise InvalidUsageError(f"commlib backend: {collective} of {describe(tensor)} is not supported; "
                                f"expected {expected} ({what})")
    if tensor.is_quantized:
        raise InvalidUsageError(f"commlib backend: {collective} of {describe(tensor)} is not supported: quantized "
                                f"tensors carry a scale the backend does not move; dequantize first")
