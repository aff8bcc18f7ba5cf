"""A host-memory stand-in for the few CuPy APIs commlib.gpu calls, for tests/mpi/gpu_standin_ranks.py.

It lets the GPU backend's *control flow* (preflight, executor ordering, the stream/event
handshake, host staging through the group's closures, GpuWork, the watchdog) run under real
mpiexec on machines without a GPU. It proves nothing about CUDA: "kernels" run at once on the
host, streams only log which stream waited on which event. Signatures follow CuPy 14 as read
from its sources (cupy/cuda/stream.pyx, cupy_backends/cuda/libs/nccl.pyx). Never on sys.path
except for that script.
"""
import numpy as np
from . import cuda
__version__ = "0.0-fake"
dtype = np.dtype
float32 = np.float32
float64 = np.float64
int32 = np.int32
int64 = np.int64

class _Dev:
    def __init__(self, i): self.id = i

class _Mem:
    def __init__(self, a): self.ptr = a.__array_interface__["data"][0]

class ndarray:
    def __init__(self, a):
        self._a = a
    __module__ = "cupy._core.core"
    flags = property(lambda s: s._a.flags)
    dtype = property(lambda s: s._a.dtype)
    shape = property(lambda s: s._a.shape)
    nbytes = property(lambda s: s._a.nbytes)
    size = property(lambda s: s._a.size)
    strides = property(lambda s: s._a.strides)
    itemsize = property(lambda s: s._a.itemsize)
    ndim = property(lambda s: s._a.ndim)
    device = property(lambda s: _Dev(cuda._current_device()))
    data = property(lambda s: _Mem(s._a))
    def reshape(self, *shape): return ndarray(self._a.reshape(*shape))
    def __getitem__(self, k): return ndarray(self._a[k])
    def __setitem__(self, k, v): self._a[k] = v._a if isinstance(v, ndarray) else v
    def __itruediv__(self, v):
        self._a /= v; return self
    def __imul__(self, v):
        self._a *= v; return self
    def get(self, stream=None):
        cuda._check_stream(stream); return self._a.copy()
    def set(self, host, stream=None):
        cuda._check_stream(stream); self._a[...] = host.reshape(self._a.shape)
    def __len__(self): return len(self._a)

def _u(x): return x._a if isinstance(x, ndarray) else x
def _ufunc(name):
    f = getattr(np, name)
    def g(a, b, out=None):
        f(_u(a), _u(b), out=_u(out)); return out
    return g
add = _ufunc("add"); minimum = _ufunc("minimum"); maximum = _ufunc("maximum"); multiply = _ufunc("multiply")
def empty(n, dtype=np.float32): return ndarray(np.empty(n, dtype=dtype))
def zeros(n, dtype=np.float32): return ndarray(np.zeros(n, dtype=dtype))
def asarray(a): return ndarray(np.array(a))
def ones(n, dtype=np.float32): return ndarray(np.ones(n, dtype=dtype))
