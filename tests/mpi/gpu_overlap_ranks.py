"""PYTHONPATH=. mpiexec -n 1 python tests/mpi/gpu_overlap_ranks.py [nccl|host_staged]

Streams and the watchdog, measured with CUDA events on one GPU:

* overlap: a ~0.3 s kernel on a compute stream, and a collective issued from another stream:
  the collective (a real ncclAllReduce of 64 MiB on the group's comm stream) finishes while the
  kernel still runs;
* ordering: the same collective issued from the compute stream starts only after the kernel;
* watchdog: a collective that cannot finish within its group's 2 s timeout (its stream waits on
  a ~6 s kernel) fails with CommTimeoutError naming op and sequence number after ~2 s, and the
  next call on that group raises at once.
"""

import sys
import time

import cupy
import numpy as np

import commlib
from commlib import CommError, CommTimeoutError, ReduceOp
from commlib.gpu import attach
from tests.support.verdict import Checker

SPIN = cupy.RawKernel(r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}""", "spin")


def spin(stream, cycles):
    with stream:
        SPIN((1,), (1,), (np.int64(cycles),))


def calibrate():
    """Clock cycles per second of the spin kernel (clock64 counts SM cycles; clocks ramp up under
    load, so warm up first)."""
    stream = cupy.cuda.Stream(non_blocking=True)
    cycles = 200_000_000
    rate = 0.0
    for _ in range(3):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        spin(stream, cycles)
        end.record(stream)
        end.synchronize()
        rate = cycles / (cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return rate


def collective(backend, x, events):
    """A real collective through the backend's issue path, with events around it on the comm stream."""
    start, end = events

    def run(transport):
        start.record()  # current stream = the comm stream
        transport.native_allreduce(x, ReduceOp.SUM)
        x[...] *= 1.0  # a kernel of real work on the comm stream (one rank's allreduce may be a no-op)
        end.record()

    return backend.issue("allreduce", run, x.nbytes, True, x, "native", (x.dtype, x.shape, "SUM", -1, "native"))


def check_overlap(check, pg, rate):
    backend = pg.gpu_backend()
    x = cupy.ones(1 << 24, dtype=cupy.float32)
    compute, issuer = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    for name, issuing_stream in (("overlap", issuer), ("ordering", compute)):
        k0, k1 = cupy.cuda.Event(), cupy.cuda.Event()
        c0, c1 = cupy.cuda.Event(), cupy.cuda.Event()
        k0.record(compute)
        spin(compute, int(0.3 * rate))
        k1.record(compute)
        with issuing_stream:
            work = collective(backend, x, (c0, c1))
        work.synchronize()
        compute.synchronize()
        kernel_ms = cupy.cuda.get_elapsed_time(k0, k1)
        start_ms = cupy.cuda.get_elapsed_time(k0, c0)
        end_ms = cupy.cuda.get_elapsed_time(k0, c1)
        line = f"{name}: kernel 0..{kernel_ms:.1f} ms, collective {start_ms:.2f}..{end_ms:.2f} ms"
        print(line, flush=True)
        if name == "overlap":
            check.check(0 <= start_ms and end_ms < kernel_ms, f"no overlap: {line}")
        else:
            check.check(start_ms >= kernel_ms - 0.01, f"collective did not wait for the caller's stream: {line}")


def check_watchdog(check, pg, rate, transport):
    sub = pg.new_group([0], timeout=2.0)
    attach(sub, transport)
    y = cupy.ones(1024, dtype=cupy.float32)
    sub.allreduce(y)  # bootstrap outside the timed part
    cupy.cuda.get_current_stream().synchronize()
    blocker = cupy.cuda.Stream(non_blocking=True)
    spin(blocker, int(6.0 * rate))  # 3x the timeout: robust to clock changes
    with blocker:
        work = sub.allreduce(y, async_op=True)
    start = time.monotonic()
    error = check.raises(CommTimeoutError, work.synchronize, "watchdog: synchronize of a stuck collective")
    waited = time.monotonic() - start
    print(f"watchdog: raised after {waited:.2f} s: {error}", flush=True)
    check.check(1.5 < waited < 4.0, f"watchdog fired after {waited:.2f} s; expected about 2 s")
    if error is not None:
        check.check("allreduce #" in str(error) and "did not complete" in str(error), f"message: {error}")
    start = time.monotonic()
    check.raises(CommError, lambda: sub.allreduce(y), "watchdog: a later call on the aborted group")
    check.check(time.monotonic() - start < 0.5, "a later call on the aborted group did not raise at once")
    blocker.synchronize()
    z = cupy.ones(16, dtype=cupy.float32)
    pg.allreduce(z)
    check.check(bool((z.get() == pg.size).all()), "the world group is still usable after the sub-group's abort")


def main():
    transport = sys.argv[1] if len(sys.argv) > 1 else "nccl"
    cupy.cuda.Device(0).use()
    pg = commlib.init(timeout=60)
    attach(pg, transport)
    check = Checker()
    pg.allreduce(cupy.zeros(4, dtype=cupy.float32))  # bootstrap (preflight, NCCL init)
    rate = calibrate()
    print(f"spin kernel: {rate / 1e9:.2f} G cycles/s", flush=True)
    check_overlap(check, pg, rate)
    check_watchdog(check, pg, rate, transport)
    check.finish()


if __name__ == "__main__":
    main()
