"""PYTHONPATH=.:tests/support/gpu_standin mpiexec -n P python tests/mpi/gpu_standin_ranks.py

The GPU backend's control flow under real MPI, with the host stand-in for CuPy in
tests/support/gpu_standin (no GPU here): bootstrap through the preflight, every collective and every
allreduce algorithm through the host-staged transport and the group's own closures, sync and
async, interleaved with CPU collectives; the stream handshake (the comm stream waits on an event
of the caller's stream, the caller's stream on the done event); with P=1 the NCCL transport's
calls in CuPy's signatures and the watchdog aborting a stuck collective; with P>1 the NCCL
transport refused on one "GPU" by the preflight. What CUDA does is checked by gpu_check.sh.
"""

import time

import numpy as np

import cupy
import commlib
from commlib import CommError, CommTimeoutError, InvalidUsageError, ReduceOp
from commlib.algorithms.registry import get_algorithm
from commlib.gpu import GpuSetupError, attach
from cupy.cuda import LOG
from tests.support.closed_form import small_values
from tests.support.verdict import Checker

assert cupy.__version__.endswith("-fake"), "gpu_standin_ranks.py must run with the stand-in, not CuPy"


def stacked(size, count):
    return np.stack([small_values(r, count, np.float64) for r in range(size)])


def check_host_staged(check, pg):
    rank, size = pg.rank, pg.size
    caller = cupy.cuda.Stream(non_blocking=True)
    issued = waited = 0
    expected = {ReduceOp.SUM: lambda s: s.sum(0), ReduceOp.AVG: lambda s: s.mean(0),
                ReduceOp.MAX: lambda s: s.max(0), ReduceOp.PROD: lambda s: s.prod(0)}
    with caller:
        for algorithm in commlib.algorithms():
            if getattr(get_algorithm(algorithm), "requires_shared_memory", False):
                # Reads the peers' host memory directly: refused for a GPU buffer, before anything runs.
                on_gpu = cupy.ndarray(small_values(rank, 4, np.float64))
                check.raises(InvalidUsageError, lambda: pg.allreduce(on_gpu, algorithm=algorithm),
                             f"{algorithm} on a GPU buffer", match="this buffer is on a GPU")
                continue
            for async_op in (False, True):
                for op in expected:
                    for count in (0, 1, 4 * size + 3):
                        buf = cupy.ndarray(small_values(rank, count, np.float64))
                        work = pg.allreduce(buf, op, algorithm=algorithm, async_op=async_op)
                        issued += 1
                        if async_op:
                            check.check(work.wait() is True and work.result() is buf, "wait/result")
                            check.check(work.synchronize() and work.is_completed(), "synchronize")
                        waited += 2 if async_op else 1  # wait() and result() each order the caller
                        check.close(buf._a, expected[op](stacked(size, count)),
                                    f"allreduce {algorithm} {op.name} n={count} async={async_op}")
                cpu = np.ones(3)
                pg.allreduce(cpu)  # CPU collectives keep their place in line
                check.equal(cpu, np.full(3, float(size)), "interleaved CPU allreduce")
        buf = cupy.ndarray(small_values(rank, 9, np.int32))
        pg.broadcast(buf, size - 1)
        check.equal(buf._a, small_values(size - 1, 9, np.int32), "broadcast")
        buf = cupy.ndarray(small_values(rank, 9, np.int32))
        pg.reduce(buf, 0, "max", async_op=True).wait()
        check.equal(buf._a, stacked(size, 9).max(0) if rank == 0 else small_values(rank, 9, np.int32), "reduce")
        out = cupy.ndarray(np.zeros(9 * size, np.int32))
        pg.allgather(out, cupy.ndarray(small_values(rank, 9, np.int32)))
        check.equal(out._a, np.concatenate([small_values(r, 9, np.int32) for r in range(size)]), "allgather")
        out = cupy.ndarray(np.zeros(3, np.float32))
        pg.reduce_scatter(out, cupy.ndarray(small_values(rank, 3 * size, np.float32)), "avg")
        check.close(out._a, stacked(size, 3 * size).mean(0)[3 * rank:3 * rank + 3], "reduce_scatter")
        issued += 4
        waited += 4
    comm = pg.gpu_backend().comm_stream.stream
    check.check(comm.non_blocking and comm.ptr != caller.ptr, "the comm stream is its own non-blocking stream")
    into_comm = sum(1 for e in LOG if e == ("wait", comm.ptr, caller.ptr))
    into_caller = sum(1 for e in LOG if e == ("wait", caller.ptr, comm.ptr))
    check.check(into_comm == issued, f"comm stream waited on the caller {into_comm} times for {issued} collectives")
    check.check(into_caller == waited, f"caller waited on the comm stream {into_caller} times, expected {waited}")
    watchdog = pg.gpu_backend().watchdog
    check.check(watchdog.in_flight() == 0 or time.sleep(0.1) or watchdog.in_flight() == 0,
                "the watchdog saw every done event")


def check_nccl_one_rank(check, pg):
    group = pg.new_group([0])
    attach(group, "nccl")
    buf = cupy.ndarray(np.arange(10, dtype=np.float32))
    group.allreduce(buf, "avg")
    group.allreduce(buf, async_op=True).wait()
    check.equal(buf._a, np.arange(10, dtype=np.float32), "one-rank NCCL allreduce")
    check.raises(InvalidUsageError, lambda: group.allreduce(cupy.ndarray(np.ones(4, np.int16)), algorithm="native"),
                 "int16 on NCCL", match="no NCCL reduction type")
    backend = group.gpu_backend()
    transport = backend.transport
    src = cupy.ndarray(np.arange(12, dtype=np.int64))
    with backend.comm_stream.active():
        for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD):
            transport.native_allreduce(src, op)
        transport.native_broadcast(src, 0)
        transport.native_reduce(src, 0, ReduceOp.SUM)
        for name, call in (("allgather", transport.native_allgather),
                           ("reduce_scatter", lambda o, i: transport.native_reduce_scatter(o, i, ReduceOp.SUM)),
                           ("send/recv", lambda o, i: transport.post(sends=[(i[:5], 0), (i[5:], 0)],
                                                                    recvs=[(o[:5], 0), (o[5:], 0)]).wait())):
            dst = cupy.ndarray(np.zeros(12, np.int64))
            call(dst, src)
            check.equal(dst._a, src._a, f"NCCL {name} through the transport")
        transport.native_barrier()
    group.close()


def check_watchdog(check, pg):
    group = pg.new_group([0], timeout=0.5)
    attach(group, "nccl")
    buf = cupy.ndarray(np.ones(3, np.float32))
    group.allreduce(buf)
    original = cupy.cuda.Event

    class NeverDone(original):
        done = property(lambda self: False)

    cupy.cuda.Event = NeverDone  # the collective's done event never fires
    try:
        work = group.allreduce(buf, async_op=True)
        while not work.has_run():  # the comm thread records the done event while the patch holds
            time.sleep(1e-3)
    finally:
        cupy.cuda.Event = original
    start = time.monotonic()
    error = check.raises(CommTimeoutError, work.synchronize, "stuck collective")
    check.check(0.3 < time.monotonic() - start < 3, "the watchdog fired after about the group's timeout")
    if error is not None:
        check.check("allreduce #3" in str(error) and "12 B" in str(error) and "did not complete" in str(error),
                    f"message: {error}")
    deadline = time.monotonic() + 2  # the abort follows the failing of the works
    while not getattr(group.gpu_backend().transport.comm, "aborted", False) and time.monotonic() < deadline:
        time.sleep(0.01)
    check.check(getattr(group.gpu_backend().transport.comm, "aborted", False), "the NCCL communicator was aborted")
    start = time.monotonic()
    check.raises(CommError, lambda: group.allreduce(buf), "later call on the aborted group")
    check.check(time.monotonic() - start < 0.5, "the later call raised at once")


def check_nccl_refused_on_one_gpu(check, pg):
    group = pg.new_group(list(range(pg.size)))
    attach(group, "nccl")
    everyone = ", ".join(map(str, range(pg.size)))
    check.raises(GpuSetupError, lambda: group.allreduce(cupy.ndarray(np.ones(2))), "NCCL on one GPU",
                 match=f"ranks {everyone} on host")
    cpu = np.ones(2)
    group.allreduce(cpu)
    check.equal(cpu, np.full(2, float(pg.size)), "group still usable after the preflight error")


def check_point_to_point_refuses_gpu_arrays(check, pg):
    """Point-to-point is host memory only: a CuPy array is refused before anything is sent, and
    the channel stays usable (the next, matching, host messages arrive)."""
    if pg.size == 1:
        return
    peer = pg.rank ^ 1 if (pg.rank ^ 1) < pg.size else pg.rank - 1
    device = cupy.ndarray(np.ones(3))
    check.raises(InvalidUsageError, lambda: pg.send(device, peer), "send of a CuPy array",
                 match="point-to-point takes numpy arrays")
    check.raises(InvalidUsageError, lambda: pg.irecv(device, peer), "irecv into a CuPy array",
                 match="nothing was sent")
    if (pg.rank ^ 1) < pg.size:  # pairs (0,1), (2,3)...: a host message still goes through
        out, got = np.full(2, float(pg.rank)), np.empty(2)
        pending = pg.irecv(got, peer)
        pg.send(out, peer)
        pending.wait()
        check.equal(got, np.full(2, float(peer)), "host message after the refusals")


def main():
    pg = commlib.init(timeout=30, segment_bytes=64)
    attach(pg, "host_staged")
    check = Checker()
    check_point_to_point_refuses_gpu_arrays(check, pg)
    check_host_staged(check, pg)
    if pg.size == 1:
        check_nccl_one_rank(check, pg)
        check_watchdog(check, pg)
    else:
        check_nccl_refused_on_one_gpu(check, pg)
    check.finish()
    commlib.shutdown()


if __name__ == "__main__":
    main()
