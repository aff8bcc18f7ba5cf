"""``GpuBackend``: a group's collectives on CuPy arrays.

Created by ``ProcessGroup.gpu_backend()`` on the first collective whose buffer is a CuPy array.
That first call bootstraps, collectively and in issue order (it is itself a task of the group's
executor, so it cannot interleave with the group's CPU collectives on the MPI communicator):
the preflight exchange (:mod:`.preflight`) picks every rank's device or raises the same error
everywhere; then the comm stream, and for the NCCL transport the communicator (rank 0's unique
id broadcast over MPI).

Every GPU collective then goes through the same executor as the CPU ones (one sequence of
numbers, one order), as a task that runs the group's closure with the comm stream current
(:class:`.streams.CommStream`). Synchronous collectives are *stream-synchronous*, like torch's
NCCL process group: the call returns once the collective is enqueued and the caller's current
stream waits for it; the CPU never blocks on the GPU unless it asks (``Work.synchronize()``,
``cupy.ndarray.get()``). Asynchronous ones return a :class:`.work.GpuWork`. A watchdog
(:mod:`.watchdog`) aborts the communicator when one does not finish within the group's timeout.

The transport is ``"nccl"`` (default) or ``"host_staged"`` (several ranks may share a GPU):
``GpuBackend(group, transport=...)``, ``commlib.gpu.attach(group, ...)`` before the first GPU
call, or ``COMMLIB_GPU_TRANSPORT``.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Dict, Optional, Union

import numpy as np

from commlib.errors import CommTimeoutError, GroupAbortedError, InvalidUsageError
from commlib.execution.issue import begin_collective
from commlib.gpu.device import import_cupy, probe_local_gpus
from commlib.gpu.preflight import TRANSPORTS, GpuSetupError, RankRecord, decide, exchange_records
from commlib.gpu.watchdog import Watchdog
from commlib.gpu.work import GpuWork
from commlib.units import format_bytes

if TYPE_CHECKING:  # imported where first needed: they import cupy's modules
    from commlib.transports.host_staged import HostStagedTransport
    from commlib.transports.nccl import NCCLTransport
    from commlib.gpu.streams import CommStream

__all__ = ["GpuBackend", "attach", "configured_transport"]

# Collectives whose NCCL native needs an element type NCCL has (int16/uint16 have none).
_TYPED_NATIVES = {"reduce", "reduce_scatter"}


def configured_transport(group) -> str:
    """The group's GPU transport: ``commlib.init(gpu_transport=...)``, else ``COMMLIB_GPU_TRANSPORT``."""
    return group.gpu_transport


def attach(group, transport: Optional[str] = None, device: Optional[int] = None) -> "GpuBackend":
    """Choose ``group``'s GPU transport/device before its first GPU collective (local, not collective):
    ``group.gpu_backend(transport, device)``."""
    return group.gpu_backend(transport, device)


class GpuBackend:
    def __init__(self, group, transport: Optional[str] = None, device: Optional[int] = None):
        kind = transport or configured_transport(group)
        if kind not in TRANSPORTS:
            raise InvalidUsageError(f"GPU transport {kind!r}: expected one of {', '.join(TRANSPORTS)}")
        self.group = group
        self.kind = kind
        self.requested_device = group.device if device is None else device
        self.device: Optional[int] = None
        # Set by the bootstrap, collectively, before the first collective runs.
        self.transport: Optional[Union[NCCLTransport, HostStagedTransport]] = None
        self.comm_stream: Optional[CommStream] = None
        self.watchdog: Optional[Watchdog] = None
        self._cupy = None
        self._ready = False
        self._setup_error: Optional[BaseException] = None
        self._bootstrap_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<GpuBackend {self.kind} device={self.device} group={self.group.name!r}>"

    # -- bootstrap ------------------------------------------------------------------------------
    def _ensure_ready(self) -> None:
        if self._ready:
            return
        with self._bootstrap_lock:
            if self._setup_error is not None:
                raise self._setup_error
            if self._ready:  # another thread bootstrapped while this one waited for the lock
                return  # type: ignore[unreachable]  # mypy cannot see the other thread
            group = self.group
            outcome: Dict[str, BaseException] = {}
            group.executor.run_sync(lambda seq: self._bootstrap(outcome), "gpu_init")
            if "error" in outcome:
                self._setup_error = outcome["error"]
                raise self._setup_error
            self._ready = True

    def _bootstrap(self, outcome) -> None:
        """Runs as an executor task. Setup errors every rank agrees on are returned, not raised:
        all ranks stay in step, so they should not poison the group's CPU collectives."""
        group = self.group
        gpus = probe_local_gpus(want_nccl=self.kind == "nccl")
        record = RankRecord(group.rank, self.kind, self.requested_device, gpus)
        records = exchange_records(group.comm, record, group.timeout)
        try:
            devices = decide(records)
        except GpuSetupError as exc:
            outcome["error"] = exc
            return
        from commlib.gpu.streams import CommStream

        cupy = import_cupy()
        self._cupy = cupy
        self.device = devices[group.rank]
        comm_stream = self.comm_stream = CommStream(cupy, self.device)
        transport: Union[NCCLTransport, HostStagedTransport]
        if self.kind == "nccl":
            from commlib.transports.nccl import NCCLTransport, create_communicator

            communicator = create_communicator(cupy, group.comm, self.device, group.timeout)
            transport = NCCLTransport(cupy, communicator, group.rank, group.size, comm_stream)
        else:
            from commlib.transports.host_staged import CupyStager, HostStagedTransport

            transport = HostStagedTransport(group.comm, CupyStager(cupy, comm_stream))
            # Host-staged MPI timeouts then name the laggard ranks, as the CPU path's do.
            transport.host.progress_board = group.progress
        transport.topology = group.topology  # hierarchical schedules ask it
        self.transport = transport
        device = self.device
        self.watchdog = Watchdog(f"{group.name}-r{group.rank}", self._on_timeout, after_failing=self._abort,
                                 thread_setup=lambda: cupy.cuda.Device(device).use())

    # -- issuing --------------------------------------------------------------------------------
    def issue(self, collective: str, run, nbytes: int, async_op: bool, result, algorithm: str,
              fingerprint):
        group = self.group
        group.executor.check_healthy()  # a watchdog abort poisons the group: raise at once
        self._ensure_ready()
        self._check_arguments(collective, result, algorithm, fingerprint)
        comm_stream = self.comm_stream
        assert comm_stream is not None  # set by _ensure_ready
        caller, ready = comm_stream.caller_ready()
        work = GpuWork(collective, nbytes, result, comm_stream, float("inf"))
        # The closure holds the flat views of the user's arrays: keep both alive until done.
        work.keepalive = (result, run)
        task = self._task(work, run, collective, algorithm, nbytes, fingerprint, ready)
        if not async_op:
            group.executor.run_sync(task, collective, nbytes, result)
            comm_stream.wait_on_caller(caller, work.done_event)
            return None
        inner = group.executor.submit(task, collective, nbytes, result)
        work.attach(inner)
        return work

    def _task(self, work, run, collective, algorithm, nbytes, fingerprint, ready):
        transport, comm_stream, watchdog, group = self.transport, self.comm_stream, self.watchdog, self.group
        assert transport is not None and comm_stream is not None and watchdog is not None  # ready

        def task(seq):
            work.seq = seq
            begin_collective(seq, collective, algorithm, nbytes, fingerprint, context=transport.context,
                             timeout=group.timeout, progress=group.progress, fingerprints=group.fingerprints)
            with comm_stream.active(ready):
                run(transport)
                work.done_event = comm_stream.record_done()
            work.deadline = time.monotonic() + group.timeout
            watchdog.track(work)

        return task

    def _check_arguments(self, collective, result, algorithm, fingerprint) -> None:
        where = getattr(getattr(result, "device", None), "id", self.device)
        if where != self.device:
            raise InvalidUsageError(
                f"{collective}: rank {self.group.rank}: the buffer is on GPU {where}, but this group "
                f"uses GPU {self.device}; allocate under cupy.cuda.Device({self.device}) or create "
                f"the group's GPU backend with device={where}"
            )
        dtype = fingerprint.dtype
        if self.kind != "nccl" or dtype is None:
            return
        from commlib.transports.nccl import nccl_reduce_dtype_ok

        typed = collective in _TYPED_NATIVES or (collective == "allreduce" and algorithm == "native")
        if typed and not nccl_reduce_dtype_ok(dtype):
            raise InvalidUsageError(
                f"{collective}: dtype {np.dtype(dtype).name} has no NCCL reduction type; expected "
                f"one of int8, uint8, int32, uint32, int64, uint64, float16, float32, float64"
                + (" (or an allreduce algorithm other than 'native')" if collective == "allreduce" else "")
            )

    # -- failure --------------------------------------------------------------------------------
    def _on_timeout(self, expired):
        group = self.group
        root = CommTimeoutError(
            f"rank {group.rank}: {expired.collective} #{expired.seq} ({format_bytes(expired.nbytes)}, "
            f"{self.kind}) did not complete on GPU {self.device} within {group.timeout:g} s; the "
            f"watchdog aborts the communicator and group {group.name!r} is unusable"
        )
        # Poison first: from here on every call on the group raises at once, so nothing new
        # reaches the communicator that after_failing (_abort) tears down.
        group.executor.record_failure(root)

        def error_for(work):
            if work is expired:
                return root
            return CommTimeoutError(
                f"rank {group.rank}: {work.collective} #{work.seq} ({format_bytes(work.nbytes)}) "
                f"failed: group {group.name!r} was aborted after {expired.collective} "
                f"#{expired.seq} timed out"
            )

        return error_for

    def _abort(self) -> None:
        abort = getattr(self.transport, "abort", None)  # host-staged: nothing on the GPU to abort
        if abort is not None:
            abort()

    # -- teardown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Called by ``ProcessGroup.close()`` after the executor drained: let the GPU finish (the
        watchdog bounds that with the group's timeout), then release the communicator."""
        if not self._ready:
            return
        watchdog, transport = self.watchdog, self.transport
        assert watchdog is not None and transport is not None  # set before _ready
        while watchdog.in_flight() and not watchdog.fired:
            time.sleep(1e-3)
        watchdog.close()
        transport.close()
        self._ready = False
        self._setup_error = GroupAbortedError(f"{self.group!r}: the GPU backend was closed")
