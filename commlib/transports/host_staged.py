"""The host-staged transport: GPU buffers, moved through host memory over MPI.

NCCL refuses two ranks on one GPU, so on a single-GPU machine this is what lets several ranks run
the whole GPU path (comm stream, events, the watchdog, DDP on CUDA tensors) with real data.

Why per slice, not whole-buffer staging: the group hands the backend a closure that runs an
algorithm on the *user's* CuPy array (``fn(transport, flat, ...)``, ``flat /= size``), so the
transport sees device slices and must move them itself. Each ``post`` copies its send slices to
host (on the comm stream, then waits for that stream: MPI must not read a half-copied buffer),
starts MPI Isend/Irecv through an :class:`MPITransport` (same tags, same deadline and timeout
messages as the CPU path), and ``wait()`` copies the received bytes back on the comm stream. The
local ``reduce`` stays a CuPy kernel on the comm stream. The natives (``"native"`` allreduce,
broadcast, ...) stage the whole buffer once and call the MPI library's collective.

Staging is pluggable (``Stager``) so the transport itself runs under mpiexec on a machine
without a GPU with a numpy stand-in; only ``CupyStager`` touches CUDA.
"""

from __future__ import annotations

import numpy as np

from commlib.transports.interface import Pending, Transport
from commlib.transports.mpi.transport import MPITransport

__all__ = ["HostStagedTransport", "CupyStager"]


class CupyStager:
    """Device <-> host copies on the comm stream (``CommStream``)."""

    def __init__(self, cupy, comm_stream):
        self.xp = cupy
        self._stream = comm_stream.stream

    def to_host(self, dev):
        # ndarray.get(stream=..., blocking=True) copies on that stream and synchronises it.
        return dev.get(stream=self._stream)

    def host_empty(self, dev):
        return np.empty(dev.size, dtype=dev.dtype)

    def to_device(self, dev, host) -> None:
        # From pageable host memory, cudaMemcpyAsync returns once the source was staged, so
        # ``host`` may be dropped right after (CUDA runtime API docs, "API synchronization").
        dev.set(host, stream=self._stream)


class _StagedPending(Pending):
    __slots__ = ("inner", "landings", "stager")

    def __init__(self, inner, landings, stager):
        self.inner = inner
        self.landings = landings
        self.stager = stager

    def wait(self) -> None:
        self.inner.wait()
        for dev, host in self.landings:
            self.stager.to_device(dev, host)


class HostStagedTransport(Transport):
    def __init__(self, mpi_comm, stager):
        super().__init__()
        self.stager = stager
        self.xp = stager.xp
        self.host = MPITransport(mpi_comm)
        self.host.context = self.context  # one context: the MPI layer's errors describe our collective
        self.rank = self.host.rank
        self.size = self.host.size

    def post(self, sends=(), recvs=()):
        stager = self.stager
        host_sends = [(stager.to_host(buf), peer) for buf, peer in sends]
        landings = [(buf, stager.host_empty(buf)) for buf, _ in recvs]
        host_recvs = [(host, peer) for (_, host), (_, peer) in zip(landings, recvs)]
        return _StagedPending(self.host.post(host_sends, host_recvs), landings, stager)

    # -- the MPI library's collectives on a host copy of the whole buffer -----------------------
    def native_allreduce(self, buf, op) -> None:
        if buf.size:
            host = self.stager.to_host(buf)
            self.host.native_allreduce(host, op)
            self.stager.to_device(buf, host)

    def native_broadcast(self, buf, root: int) -> None:
        if buf.size:
            host = self.stager.to_host(buf) if self.rank == root else self.stager.host_empty(buf)
            self.host.native_broadcast(host, root)
            if self.rank != root:
                self.stager.to_device(buf, host)

    def native_reduce(self, buf, root: int, op) -> None:
        if buf.size:
            host = self.stager.to_host(buf)
            self.host.native_reduce(host, root, op)
            if self.rank == root:
                self.stager.to_device(buf, host)

    def native_allgather(self, out, inp) -> None:
        if inp.size:
            host_out = self.stager.host_empty(out)
            self.host.native_allgather(host_out, self.stager.to_host(inp))
            self.stager.to_device(out, host_out)

    def native_reduce_scatter(self, out, inp, op) -> None:
        if out.size:
            host_out = self.stager.host_empty(out)
            self.host.native_reduce_scatter(host_out, self.stager.to_host(inp), op)
            self.stager.to_device(out, host_out)

    def native_barrier(self) -> None:
        self.host.native_barrier()

    def close(self) -> None:
        super().close()
        self.host.release_scratch()
