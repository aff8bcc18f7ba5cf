"""CuPy on torch's CUDA stream: how a commlib collective is ordered after torch's kernels.

commlib's GPU backend orders its comm stream after CuPy's *current* stream (and, for a sync call,
makes that stream wait for the result). Making torch's current stream CuPy's current stream for
the duration of a call is therefore all a caller needs to order a collective after the kernels
that produced its tensors. Importing this module needs neither CuPy nor CUDA.
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


@contextlib.contextmanager
def on_torch_stream(device: torch.device):
    """CuPy's current device and stream := torch's, for this thread (untested: no GPU here)."""
    import cupy

    stream = torch.cuda.current_stream(device)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    cupy_stream = (from_external(_TorchStreamRef(stream)) if from_external is not None
                   else cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index))
    with cupy.cuda.Device(stream.device.index), cupy_stream:
        yield
