"""The CUDA stream contract between autograd, the reducer and commlib's GPU backend.

Untested here: the development machine has no GPU. Written to the contract below so it runs
(and can be checked) as soon as a GPU is there; on CPU tensors every function is a no-op.

The contract, following torch's ProcessGroupNCCL:

1. Gradients are copied into a bucket on the stream autograd runs the parameter's
   ``AccumulateGrad`` on, which is torch's *current* stream inside the grad-ready hook.
2. commlib's GPU backend issues a collective on the group's own comm stream after making that
   stream wait on an event recorded on **cupy's current stream** at issue time; ``work.wait()``
   makes cupy's current stream wait on the collective's end event (no CPU block).
3. torch and cupy keep separate notions of "current stream". So the reducer issues and waits
   inside ``on_torch_stream(device)``, which makes cupy's current stream the torch current
   stream: the collective is ordered after the bucket copy (1), and the write-back of the
   averaged gradients, issued on the same torch stream at the end of backward, after the
   collective (2).
4. torch's caching allocator only knows the stream a tensor was allocated on. Bucket buffers are
   used on the comm stream too, so the reducer keeps them referenced for the life of the DDP
   object (never freed while a collective may use them); temporaries of comm hooks (the fp16
   copy) are kept alive by the hook's work until the result has been waited for.
"""

from __future__ import annotations

import contextlib

import torch

from autograd_bridge.cuda_streams import on_torch_stream as _cupy_on_torch_stream

__all__ = ["on_torch_stream"]


def on_torch_stream(device: torch.device):
    """Context in which commlib's GPU calls use torch's current stream of ``device`` (CPU: nothing)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return _cupy_on_torch_stream(device)
