"""The NCCL transport: the transport interface over a ``cupy.cuda.nccl.NcclCommunicator``.

Every call is enqueued on the group's comm stream, which is the current CuPy stream while a GPU
collective runs (``CommStream.active``); so ``Pending.wait()`` has nothing to wait for: the
stream orders the next step after this one, and the local ``reduce`` (a CuPy ufunc, inherited
from :class:`Transport` with ``xp = cupy``) runs on the same stream. One step's sends and
receives sit in one ``groupStart/groupEnd``: NCCL matches a ring step's send and receive only
inside one group, outside it the step can deadlock.

Point-to-point traffic is sent as bytes (``NCCL_UINT8``), so every dtype travels; the natives
(``ncclAllReduce`` ...) need NCCL's element type, and int16/uint16 have none: the backend refuses
those before anything is enqueued (:func:`nccl_reduce_dtype_ok`).

NCCL is not thread-safe per communicator, and ``abort()`` comes from the watchdog thread: every
call holds ``lock``.
"""

from __future__ import annotations

import pickle
import threading
import time

import numpy as np

from commlib.errors import CommError, CommTimeoutError
from commlib.ops import ReduceOp
from commlib.transports.interface import CompletedPending, Transport

__all__ = ["NCCLTransport", "create_communicator", "nccl_reduce_dtype_ok", "NCCL_DTYPE_NAMES"]

# Values of ncclDataType_t / ncclRedOp_t (nccl.h); CuPy exposes the same numbers as
# nccl.NCCL_FLOAT32 etc. We look them up by name on the module and fall back to these.
NCCL_DTYPE_NAMES = {
    "int8": ("NCCL_INT8", 0), "uint8": ("NCCL_UINT8", 1), "int32": ("NCCL_INT32", 2),
    "uint32": ("NCCL_UINT32", 3), "int64": ("NCCL_INT64", 4), "uint64": ("NCCL_UINT64", 5),
    "float16": ("NCCL_FLOAT16", 6), "float32": ("NCCL_FLOAT32", 7), "float64": ("NCCL_FLOAT64", 8),
    "bfloat16": ("NCCL_BFLOAT16", 9),
}
NCCL_OP_NAMES = {
    ReduceOp.SUM: ("NCCL_SUM", 0), ReduceOp.PROD: ("NCCL_PROD", 1),
    ReduceOp.MAX: ("NCCL_MAX", 2), ReduceOp.MIN: ("NCCL_MIN", 3),
}
UNIQUE_ID_BUFFER = 1024


def nccl_reduce_dtype_ok(dtype) -> bool:
    return np.dtype(dtype).name in NCCL_DTYPE_NAMES


def _const(nccl, table, key):
    name, value = table[key]
    return getattr(nccl, name, value)


def create_communicator(cupy, mpi_comm, device: int, timeout: float):
    """Rank 0's unique id, broadcast over MPI, then ``ncclCommInitRank`` on ``device``.

    The id travels pickled (a 128-byte ``bytes`` in CuPy 14, a tuple of ints before) in a
    fixed-size buffer, so one nonblocking ``MPI_Ibcast`` with the group's deadline carries it.
    """
    from cupy.cuda import nccl

    from commlib.platform.waiting import wait_all

    rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
    buf = np.zeros(UNIQUE_ID_BUFFER, dtype=np.uint8)
    if rank == 0:
        payload = pickle.dumps(nccl.get_unique_id())
        buf[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    request = mpi_comm.Ibcast(buf, root=0)
    if not wait_all([request], time.monotonic() + timeout):
        raise CommTimeoutError(f"rank {rank}: NCCL bootstrap timed out after {timeout:g} s waiting "
                               f"for rank 0's unique id")
    unique_id = pickle.loads(buf.tobytes())
    with cupy.cuda.Device(device):
        # Blocks (GIL released) until all `size` ranks joined; the preflight made sure they will.
        return nccl.NcclCommunicator(size, unique_id, rank)


class NCCLTransport(Transport):
    def __init__(self, cupy, communicator, rank: int, size: int, comm_stream):
        super().__init__()
        from cupy.cuda import nccl

        self.xp = cupy
        self._nccl = nccl
        self.comm = communicator
        self.rank = rank
        self.size = size
        self.stream = comm_stream  # CommStream
        self.lock = threading.Lock()
        self.aborted = False
        self._uint8 = _const(nccl, NCCL_DTYPE_NAMES, "uint8")

    # -- helpers --------------------------------------------------------------------------------
    def _dtype(self, dtype) -> int:
        return _const(self._nccl, NCCL_DTYPE_NAMES, np.dtype(dtype).name)

    def _op(self, op: ReduceOp) -> int:
        return _const(self._nccl, NCCL_OP_NAMES, op)

    @property
    def _stream_ptr(self) -> int:
        return self.stream.stream.ptr

    def _call(self, what: str, fn, *args) -> None:
        with self.lock:
            if self.aborted:
                raise CommError(f"rank {self.rank}: {self.context.describe()}: the NCCL communicator "
                                f"was aborted (an earlier collective timed out)")
            try:
                fn(*args)
            except self._nccl.NcclError as exc:
                raise CommError(f"rank {self.rank}: {self.context.describe()}: {what} failed: {exc}") from exc

    # -- point to point -------------------------------------------------------------------------
    def post(self, sends=(), recvs=()):
        sends = [(buf, peer) for buf, peer in sends if buf.nbytes]
        recvs = [(buf, peer) for buf, peer in recvs if buf.nbytes]
        if not sends and not recvs:
            return CompletedPending()
        self._call("send/recv group", self._group, sends, recvs)
        return CompletedPending()

    def _group(self, sends, recvs) -> None:
        nccl, comm, stream, uint8 = self._nccl, self.comm, self._stream_ptr, self._uint8
        nccl.groupStart()
        try:
            for buf, peer in recvs:
                comm.recv(buf.data.ptr, buf.nbytes, uint8, peer, stream)
            for buf, peer in sends:
                comm.send(buf.data.ptr, buf.nbytes, uint8, peer, stream)
        finally:
            nccl.groupEnd()

    # -- NCCL's own collectives -------------------------------------------------------------------
    def native_allreduce(self, buf, op) -> None:
        if buf.size:
            ptr = buf.data.ptr
            self._call("ncclAllReduce", self.comm.allReduce, ptr, ptr, buf.size, self._dtype(buf.dtype),
                       self._op(op), self._stream_ptr)

    def native_broadcast(self, buf, root: int) -> None:
        if buf.size:
            ptr = buf.data.ptr
            self._call("ncclBroadcast", self.comm.broadcast, ptr, ptr, buf.nbytes, self._uint8, root,
                       self._stream_ptr)

    def native_reduce(self, buf, root: int, op) -> None:
        if buf.size:
            ptr = buf.data.ptr
            self._call("ncclReduce", self.comm.reduce, ptr, ptr, buf.size, self._dtype(buf.dtype),
                       self._op(op), root, self._stream_ptr)

    def native_allgather(self, out, inp) -> None:
        if inp.size:
            self._call("ncclAllGather", self.comm.allGather, inp.data.ptr, out.data.ptr, inp.nbytes,
                       self._uint8, self._stream_ptr)

    def native_reduce_scatter(self, out, inp, op) -> None:
        if out.size:
            self._call("ncclReduceScatter", self.comm.reduceScatter, inp.data.ptr, out.data.ptr,
                       out.size, self._dtype(out.dtype), self._op(op), self._stream_ptr)

    def native_barrier(self) -> None:
        token = self.scratch(1, np.int32, slot=99)
        self.native_allreduce(token, ReduceOp.SUM)

    # -- teardown -------------------------------------------------------------------------------
    def abort(self, lock_timeout: float = 2.0) -> None:
        """``ncclCommAbort``: stuck kernels return, the communicator is gone.

        Taken under the lock when we can get it; a call blocked inside NCCL while holding the
        lock can only be freed by the abort itself, so after ``lock_timeout`` we abort without it.
        """
        got = self.lock.acquire(timeout=lock_timeout)
        try:
            if not self.aborted:
                self.aborted = True
                self.comm.abort()
        finally:
            if got:
                self.lock.release()

    def close(self) -> None:
        super().close()
        with self.lock:
            if not self.aborted:
                self.aborted = True
                self.comm.destroy()
