"""Allreduce benchmark, in the manner of nccl-tests, with MPI's own allreduce as the baseline.

Run::

    mpiexec -n 4 python -m commlib.bench                      # 8 B .. 64 MiB, every algorithm
    mpiexec -n 2 python -m commlib.bench -b 1M -e 64M -f 4 -a ring,rabenseifner --json out.json

For each size it first times ``MPI_Allreduce`` in place, called directly through mpi4py (not
through commlib), then each commlib algorithm through ``ProcessGroup.allreduce``. Every timed
iteration starts from a fresh copy of the rank-derived input and is separated from the next by a
barrier; a row reports the median over iterations of the slowest rank's time, algbw = bytes /
time, busbw = algbw * 2(P-1)/P (the per-link traffic of a bandwidth-optimal allreduce), #wrong =
elements that differ from the closed-form result after the last iteration (summed over ranks), and
the ratio of the row's time to MPI's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
from mpi4py import MPI

__all__ = ["main", "parse_size"]

BASELINE = "MPI_Allreduce"
DEFAULT_ALGORITHMS = "native,ring,tree,recursive_doubling,rabenseifner,hierarchical,auto"
_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"8"``, ``"64K"``, ``"4MiB"`` -> bytes."""
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGIB")
    suffix = stripped[len(digits):]
    if not digits.isdigit() or suffix not in _SUFFIXES:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected an integer with an optional K/M/G suffix")
    return int(digits) * _SUFFIXES[suffix]


def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m commlib.bench", description=__doc__.split("\n")[0])
    parser.add_argument("-b", "--min-bytes", type=parse_size, default=8, help="smallest size (default 8)")
    parser.add_argument("-e", "--max-bytes", type=parse_size, default=64 << 20, help="largest size (default 64M)")
    parser.add_argument("-f", "--step-factor", type=int, default=2, help="size multiplier per row (default 2)")
    parser.add_argument("-d", "--dtype", default="float32",
                        help="float16/32/64, bfloat16, int8/32/64, uint8 (default float32)")
    parser.add_argument("-o", "--op", default="sum", choices=["sum", "min", "max", "prod"])
    parser.add_argument("-a", "--algorithms", default=DEFAULT_ALGORITHMS,
                        help=f"comma-separated commlib algorithms (default {DEFAULT_ALGORITHMS})")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per row (default 20)")
    parser.add_argument("-w", "--warmup", type=int, default=3, help="untimed iterations per row (default 3)")
    parser.add_argument("-s", "--segment-bytes", type=parse_size, default=None,
                        help="pipeline segment size for ring/tree/rabenseifner (default: commlib's config)")
    parser.add_argument("--no-baseline", action="store_true", help=f"skip the {BASELINE} rows")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON (rank 0)")
    args = parser.parse_args(argv)
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        parser.error(f"sizes: expected 1 <= min ({args.min_bytes}) <= max ({args.max_bytes})")
    if args.step_factor < 2:
        parser.error(f"--step-factor: expected >= 2, got {args.step_factor}")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    return args


def resolve_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def rank_input(rank: int, count: int, dtype, op: str) -> np.ndarray:
    """Small integers (exact in every dtype, summed or multiplied over a few ranks)."""
    index = np.arange(count, dtype=np.int64)
    values = (index + rank) % 2 + 1 if op == "prod" else (index + rank) % 3 + 1
    return values.astype(dtype)


def expected_result(size: int, count: int, dtype, op: str) -> np.ndarray:
    combine = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}[op]
    total = rank_input(0, count, np.int64, op)
    for rank in range(1, size):
        combine(total, rank_input(rank, count, np.int64, op), out=total)
    return total.astype(dtype)


def mpi_baseline(comm, dtype, op: str):
    """In-place ``MPI_Allreduce`` on ``comm`` (bfloat16: a numpy user op, MPI has none)."""
    mpi_ops = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}
    datatype = None
    if dtype.name != "bfloat16":
        try:
            datatype = MPI.Datatype.fromcode(dtype.char)
        except (KeyError, ValueError):
            datatype = None
    if datatype is None:
        datatype = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()
        combine = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}[op]

        def apply(inbuf, inoutbuf, _datatype):
            out = np.frombuffer(inoutbuf, dtype=dtype)
            combine(np.frombuffer(inbuf, dtype=dtype), out, out=out)

        mpi_op = MPI.Op.Create(apply, commute=True)
    else:
        mpi_op = mpi_ops[op]

    def run(buf):
        comm.Allreduce(MPI.IN_PLACE, [buf, buf.size, datatype], mpi_op)

    return run


def time_rows(comm, run, buf, pristine, iters: int, warmup: int) -> float:
    """Median over iterations of the slowest rank's seconds; ``buf`` holds the last result."""
    times = np.empty(iters)
    for iteration in range(warmup + iters):
        np.copyto(buf, pristine)
        comm.Barrier()
        start = time.perf_counter()
        run(buf)
        elapsed = time.perf_counter() - start
        if iteration >= warmup:
            times[iteration - warmup] = elapsed
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return float(np.median(times))


HEADER = (f"{'size':>10} {'count':>10} {'dtype':>8} {'algorithm':>18} {'time(us)':>10} "
          f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7} {'ratio':>6}")


def format_row(row: dict) -> str:
    return (f"{row['size']:>10} {row['count']:>10} {row['dtype']:>8} {row['algorithm']:>18} "
            f"{row['time_us']:>10.1f} {row['algbw_gbs']:>11.3f} {row['busbw_gbs']:>11.3f} "
            f"{row['wrong']:>7} {row['ratio']:>6.2f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import commlib
    from commlib.ops import ReduceOp

    pg = commlib.init(segment_bytes=args.segment_bytes)
    comm = MPI.COMM_WORLD.Dup()  # the baseline's own communicator, outside commlib
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = resolve_dtype(args.dtype)
    algorithms = [name for name in args.algorithms.split(",") if name]
    known = set(commlib.algorithms()) | {"auto"}
    unknown = [name for name in algorithms if name not in known]
    if unknown:
        if rank == 0:
            print(f"unknown algorithm(s) {unknown}: expected some of {sorted(known)}", file=sys.stderr)
        return 2
    op = ReduceOp[args.op.upper()]
    baseline = None if args.no_baseline else mpi_baseline(comm, dtype, args.op)
    bus_factor = 2 * (size - 1) / size if size > 1 else 1.0
    rows = []
    if rank == 0:
        print(f"# commlib allreduce benchmark: {size} ranks, dtype {dtype.name}, op {args.op}, "
              f"segment_bytes {pg.segment_bytes}, {args.iters} iterations (+{args.warmup} warm-up), "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
        print(f"# time: median over iterations of the slowest rank; ratio: time / {BASELINE}'s")
        print(f"# ranks per host: {pg.topology.describe()}")
        print(HEADER, flush=True)
    nbytes = args.min_bytes
    while nbytes <= args.max_bytes:
        count = max(1, nbytes // dtype.itemsize)
        pristine = rank_input(rank, count, dtype, args.op)
        expected = expected_result(size, count, dtype, args.op)
        buf = np.empty_like(pristine)
        contenders = ([(BASELINE, baseline)] if baseline is not None else []) + [
            (name, lambda b, name=name: pg.allreduce(b, op, algorithm=name)) for name in algorithms]
        baseline_time = None
        for name, run in contenders:
            seconds = time_rows(comm, run, buf, pristine, args.iters, args.warmup)
            wrong = comm.allreduce(int(np.count_nonzero(buf != expected)))
            if name == BASELINE:
                baseline_time = seconds
            algbw = count * dtype.itemsize / seconds / 1e9
            row = dict(size=count * dtype.itemsize, count=count, dtype=dtype.name, algorithm=name,
                       time_us=seconds * 1e6, algbw_gbs=algbw, busbw_gbs=algbw * bus_factor,
                       wrong=wrong, ratio=seconds / baseline_time if baseline_time else float("nan"),
                       ranks=size, segment_bytes=pg.segment_bytes,
                       hosts=[list(ranks) for ranks in pg.topology.host_ranks])
            rows.append(row)
            if rank == 0:
                print(format_row(row), flush=True)
        nbytes *= args.step_factor
    total_wrong = sum(row["wrong"] for row in rows)
    if rank == 0:
        print(f"# out of bounds values: {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)
    comm.Free()
    return 1 if total_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
