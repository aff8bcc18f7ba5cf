"""PYTHONPATH=. mpiexec -n P python tests/mpi/gpu_collectives_ranks.py {nccl|host_staged}

Every collective on CUDA tensors (viewed as CuPy arrays through DLPack, zero-copy, as the torch
bridge does) against torch's own reduction of the same rank-derived inputs: op x dtype x size,
every allreduce algorithm, sync and async. Also the stream contract (a collective issued right
after a slow kernel on the caller's stream reads what that kernel wrote; the caller's stream sees
the result with no CPU wait) and, on one rank with NCCL, NCCL's own collectives and a self
send/recv through the transport directly (a one-rank group never calls them otherwise).
Needs a GPU: run by scripts/gpu_check.sh and by tests/test_gpu.py (skipped without a GPU).
"""

import sys
import time

import cupy
import numpy as np
import torch

import commlib
from commlib import InvalidUsageError, ReduceOp
from commlib.algorithms.registry import algorithm_names
from commlib.gpu import attach
from tests.support.verdict import Checker

DTYPES = [torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64]
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD]
SPIN = cupy.RawKernel(r"""
extern "C" __global__ void spin_then_set(long long cycles, float* out, float value) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    out[threadIdx.x] = value;
}""", "spin_then_set")


def as_cupy(tensor):
    return cupy.from_dlpack(tensor.detach())


def torch_stream_current():
    """CuPy's current stream := torch's current stream (what autograd_bridge.on_torch_stream does)."""
    return cupy.cuda.Stream.from_external(_Ref(torch.cuda.current_stream()))


class _Ref:
    def __init__(self, stream):
        self.stream = stream

    def __cuda_stream__(self):
        return (0, self.stream.cuda_stream)


def rank_tensor(rank, count, dtype):
    return ((torch.arange(count, device="cuda") + rank) % 3 + 1).to(dtype)


def torch_reduce(size, count, dtype, op):
    stacked = torch.stack([rank_tensor(r, count, torch.float64) for r in range(size)])
    if op is ReduceOp.SUM:
        out = stacked.sum(0)
    elif op is ReduceOp.AVG:
        out = stacked.mean(0)
    elif op is ReduceOp.MIN:
        out = stacked.amin(0)
    elif op is ReduceOp.MAX:
        out = stacked.amax(0)
    else:
        out = stacked.prod(0)
    return out.to(dtype)


def same(check, actual, expected, what):
    if actual.dtype.is_floating_point:
        tol = 1e-2 if actual.dtype == torch.float16 else 1e-5
        ok = torch.allclose(actual.double(), expected.double(), rtol=tol, atol=tol)
    else:
        ok = torch.equal(actual, expected)
    if not ok:
        bad = (actual.double() - expected.double()).abs().argmax().item() if actual.numel() else 0
        check.check(False, f"{what}: first large difference at {bad}: got {actual.flatten()[bad].item()}, "
                           f"expected {expected.flatten()[bad].item()}")
    else:
        check.check(True, "")


def run(pg, fn, async_op, *args, **kwargs):
    work = fn(*args, async_op=async_op, **kwargs)
    if async_op:
        check_work = work.wait()
        assert check_work is True
    return work


def check_allreduce(check, pg, transport):
    rank, size = pg.rank, pg.size
    counts = [0, 1, max(size - 1, 1), 7 * size + 3, (1 << 16) + 1]
    algorithms = ["native"] + [a for a in algorithm_names() if a != "native"]
    flip = 0
    for algorithm in algorithms:
        for dtype in DTYPES:
            for op in OPS:
                if op is ReduceOp.AVG and not dtype.is_floating_point:
                    continue
                for count in counts:
                    flip += 1
                    t = rank_tensor(rank, count, dtype)
                    run(pg, pg.allreduce, flip % 2 == 0, as_cupy(t), op, algorithm=algorithm)
                    same(check, t, torch_reduce(size, count, dtype, op),
                         f"allreduce {algorithm} {dtype} {op.name} n={count} async={flip % 2 == 0}")
    big = (1 << 20) + 3
    for algorithm in algorithms:
        t = rank_tensor(rank, big, torch.float32)
        work = pg.allreduce(as_cupy(t), algorithm=algorithm, async_op=True)
        work.synchronize()
        check.check(work.is_completed() and work.is_success(), f"{algorithm}: work not complete after synchronize")
        same(check, t, torch_reduce(size, big, torch.float32, ReduceOp.SUM), f"allreduce {algorithm} 4 MiB")
    if transport == "nccl":
        t = rank_tensor(rank, 10, torch.int16)
        check.raises(InvalidUsageError, lambda: pg.allreduce(as_cupy(t), algorithm="native"),
                     "int16 native allreduce on NCCL", match="no NCCL reduction type")


def check_other_collectives(check, pg):
    rank, size = pg.rank, pg.size
    flip = 0
    for dtype in DTYPES:
        for count in (0, 1, 7 * size + 3, 1 << 16):
            flip += 1
            async_op = flip % 2 == 0
            root = count % size
            t = rank_tensor(rank, count, dtype)
            run(pg, pg.broadcast, async_op, as_cupy(t), root)
            same(check, t, rank_tensor(root, count, dtype), f"broadcast {dtype} n={count}")

            for op in (ReduceOp.SUM, ReduceOp.MAX):
                t = rank_tensor(rank, count, dtype)
                run(pg, pg.reduce, async_op, as_cupy(t), root, op)
                expected = torch_reduce(size, count, dtype, op) if rank == root else rank_tensor(rank, count, dtype)
                same(check, t, expected, f"reduce {dtype} {op.name} n={count} root={root}")

            inp = rank_tensor(rank, count, dtype)
            out = torch.empty(count * size, dtype=dtype, device="cuda")
            run(pg, pg.allgather, async_op, as_cupy(out), as_cupy(inp))
            expected = torch.cat([rank_tensor(r, count, dtype) for r in range(size)])
            same(check, out, expected, f"allgather {dtype} n={count}")

            inp = rank_tensor(rank, count * size, dtype)
            out = torch.empty(count, dtype=dtype, device="cuda")
            run(pg, pg.reduce_scatter, async_op, as_cupy(out), as_cupy(inp), ReduceOp.SUM)
            full = torch_reduce(size, count * size, dtype, ReduceOp.SUM)
            same(check, out, full[rank * count:(rank + 1) * count], f"reduce_scatter {dtype} n={count}")


def check_stream_contract(check, pg):
    """Issue right after a slow kernel that writes the input: the collective must see its value."""
    rank, size = pg.rank, pg.size
    for async_op in (False, True):
        t = torch.zeros(32, device="cuda")
        SPIN((1,), (32,), (np.int64(200_000_000), as_cupy(t), np.float32(rank + 1)))  # ~0.1 s on the current stream
        work = pg.allreduce(as_cupy(t), async_op=async_op)
        if async_op:
            work.wait()
        # No CPU sync: this torch kernel is ordered after the collective by the stream wait.
        got = t.clone()
        same(check, got, torch.full((32,), float(size * (size + 1) // 2), device="cuda"),
             f"stream contract async={async_op}")


def check_nccl_natives(check, pg):
    """One rank: NCCL's collectives and a self send/recv, called on the transport directly."""
    backend = pg.gpu_backend()
    transport = backend.transport
    for dtype in DTYPES:
        for count in (0, 1, 1000, (1 << 20) + 3):
            src = rank_tensor(0, count, dtype)
            for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD):
                buf = src.clone()
                torch.cuda.synchronize()  # torch wrote buf on its stream; the transport uses the comm stream
                with backend.comm_stream.active():
                    transport.native_allreduce(as_cupy(buf), op)
                backend.comm_stream.synchronize()
                same(check, buf, src, f"ncclAllReduce {dtype} {op.name} n={count}")
            out, b, r = torch.empty_like(src), src.clone(), src.clone()
            rs, recv = torch.empty_like(src), torch.empty_like(src)
            torch.cuda.synchronize()
            with backend.comm_stream.active():
                transport.native_allgather(as_cupy(out), as_cupy(src))
                transport.native_broadcast(as_cupy(b), 0)
                transport.native_reduce(as_cupy(r), 0, ReduceOp.SUM)
                transport.native_reduce_scatter(as_cupy(rs), as_cupy(src), ReduceOp.MAX)
                transport.post(sends=[(as_cupy(src), 0)], recvs=[(as_cupy(recv), 0)]).wait()
            backend.comm_stream.synchronize()
            for name, value in (("allGather", out), ("broadcast", b), ("reduce", r), ("reduceScatter", rs),
                                ("self send/recv", recv)):
                same(check, value, src, f"nccl {name} {dtype} n={count}")


def main():
    transport = sys.argv[1] if len(sys.argv) > 1 else "nccl"
    torch.cuda.set_device(0)
    pg = commlib.init(timeout=120, segment_bytes=1 << 14)
    attach(pg, transport)
    check = Checker()
    start = time.monotonic()
    with torch_stream_current():
        check_allreduce(check, pg, transport)
        check_other_collectives(check, pg)
        check_stream_contract(check, pg)
        if transport == "nccl" and pg.size == 1:
            check_nccl_natives(check, pg)
    torch.cuda.synchronize()
    if pg.rank == 0:
        print(f"{transport} P={pg.size}: {time.monotonic() - start:.1f} s")
    check.finish()
    commlib.shutdown()


if __name__ == "__main__":
    main()
