"""CuPy on torch's CUDA stream: how a commlib collective is ordered after torch's kernels.

commlib's GPU backend orders its comm stream after CuPy's *current* stream (and, for a sync call,
makes that stream wait for the result). Making torch's current stream CuPy's current stream for
the duration of a call is therefore all a caller needs to order a collective after the kernels
that produced its tensors. Importing this module needs neither CuPy nor CUDA, and on a CPU
device :func:`on_torch_stream` does nothing.

The contract, following torch's ProcessGroupNCCL:

1. Gradients are copied into a bucket on the stream autograd runs the parameter's
   ``AccumulateGrad`` on, which is torch's *current* stream inside the grad-ready hook.
2. commlib's GPU backend issues a collective on the group's own comm stream after making that
   stream wait on an event recorded on **cupy's current stream** at issue time; ``work.wait()``
   makes cupy's current stream wait on the collective's end event (no CPU block).
3. torch and cupy keep separate notions of "current stream". So DDP's reducer issues and waits
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

__all__ = ["on_torch_stream"]


class _TorchStreamRef:
    """The ``__cuda_stream__`` protocol over a torch stream (what CuPy's ``from_external`` takes)."""

    def __init__(self, stream):
        self._stream = stream

    def __cuda_stream__(self):
        return (0, self._stream.cuda_stream)


def on_torch_stream(device: torch.device):
    """Context in which CuPy's current device and stream are torch's, for this thread (a CUDA
    device; untested: no GPU here), or nothing (any other device)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return _cupy_on_torch_stream(device)


@contextlib.contextmanager
def _cupy_on_torch_stream(device: torch.device):
    import cupy

    stream = torch.cuda.current_stream(device)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    cupy_stream = (from_external(_TorchStreamRef(stream)) if from_external is not None
                   else cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index))
    with cupy.cuda.Device(stream.device.index), cupy_stream:
        yield
