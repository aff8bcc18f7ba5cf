"""The group's dedicated CUDA stream and the event handshake with the caller's stream.

Ordering, as in torch's ProcessGroupNCCL: at issue time an event is recorded on the *caller's*
current stream (in the caller's thread: CuPy's current stream is thread-local, so the
communication thread could not see it); the comm stream waits on that event, so the collective
reads the buffer only after the kernels that produced it; the collective runs on the comm stream;
a done event is recorded there. ``Work.wait()`` makes the caller's current stream wait on the
done event: the CPU does not block, later kernels on that stream see the result.

The comm stream is created ``non_blocking``: a blocking stream would synchronise implicitly with
the legacy default stream (where torch and CuPy put work by default) and nothing would overlap.
Only CuPy's notion of the current stream is used here; the torch bridge makes torch's current
stream CuPy-current (``cupy.cuda.Stream.from_external(torch.cuda.current_stream())``) when it
is not the default stream.
"""

from __future__ import annotations

import contextlib

__all__ = ["CommStream"]


class CommStream:
    def __init__(self, cupy, device: int):
        self._cupy = cupy
        self.device = device
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)

    def caller_ready(self):
        """``(caller_stream, event)``: the calling thread's current stream and an event recorded on it."""
        cuda = self._cupy.cuda
        with cuda.Device(self.device):
            caller = cuda.get_current_stream()
            event = cuda.Event(disable_timing=True)
            event.record(caller)
        return caller, event

    @contextlib.contextmanager
    def active(self, ready_event=None):
        """Run the body with this device and the comm stream current (CuPy kernels go there),
        after the comm stream waited on ``ready_event``."""
        cuda = self._cupy.cuda
        with cuda.Device(self.device):
            if ready_event is not None:
                self.stream.wait_event(ready_event)
            with self.stream:
                yield self.stream

    def record_done(self):
        event = self._cupy.cuda.Event(disable_timing=True)
        event.record(self.stream)
        return event

    def wait_on_caller(self, caller_stream, done_event) -> None:
        with self._cupy.cuda.Device(self.device):
            caller_stream.wait_event(done_event)

    def synchronize(self) -> None:
        with self._cupy.cuda.Device(self.device):
            self.stream.synchronize()
