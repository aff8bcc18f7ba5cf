"""Stand-in for cupy.cuda: devices, streams and events as host objects that log waits."""
import threading
from . import runtime as runtime  # submodules that are attributes in CuPy too
from . import nccl as nccl
_tls = threading.local()
LOG = []

def _current_device():
    return getattr(_tls, "device", 0)

def _check_stream(stream):
    if stream is not None and not isinstance(stream, Stream):
        raise TypeError(f"not a stream: {stream!r}")

class Device:
    def __init__(self, i=None): self.id = _current_device() if i is None else i
    def use(self): _tls.device = self.id
    def __enter__(self):
        self._prev = _current_device(); _tls.device = self.id; return self
    def __exit__(self, *a): _tls.device = self._prev

class Event:
    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.recorded_on = None
    def record(self, stream=None):
        self.recorded_on = stream if stream is not None else get_current_stream()
        LOG.append(("record", self.recorded_on.ptr))
    @property
    def done(self): return self.recorded_on is not None
    def synchronize(self): pass

_next_ptr = [100]
class Stream:
    def __init__(self, null=False, non_blocking=False, ptds=False, priority=None):
        if null: self.ptr = 0
        else:
            _next_ptr[0] += 1; self.ptr = _next_ptr[0]
        self.device_id = _current_device()
        self.non_blocking = non_blocking
    def __enter__(self):
        st = getattr(_tls, "stack", None)
        if st is None: st = _tls.stack = []
        st.append(self); return self
    def __exit__(self, *a): _tls.stack.pop()
    def use(self): _tls.base = self; return self
    def wait_event(self, event):
        assert event.recorded_on is not None, "waiting on an unrecorded event"
        LOG.append(("wait", self.ptr, event.recorded_on.ptr))
    def synchronize(self): pass
    def record(self, event=None):
        event = event or Event(); event.record(self); return event
    done = True
Stream.null = Stream(null=True)

def get_current_stream(device_id=-1):
    st = getattr(_tls, "stack", None)
    if st: return st[-1]
    return getattr(_tls, "base", Stream.null)

def get_elapsed_time(a, b): return 0.0
