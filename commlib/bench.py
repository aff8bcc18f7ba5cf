"""Collective benchmark in the manner of nccl-tests, with the MPI library's own as the baseline.

Run::

    mpiexec -n 4 python -m commlib.bench                              # allreduce, 8 B .. 64 MiB
    mpiexec -n 2 python -m commlib.bench --collective allgather -b 1M -e 64M -f 4 --json out.json
    mpiexec -n 4 python -m commlib.bench --collective broadcast -a binomial,chain,native
    mpiexec -n 2 python -m commlib.bench -a native,ring,shm_oneshot,shm_twoshot,auto --symmetric
    mpiexec -n 4 python -m commlib.bench --collective barrier -n 200

``--collective`` is allreduce (default), broadcast, reduce, allgather, reduce_scatter, alltoall,
gather, scatter or barrier.
For each size it first times the MPI library's collective called directly through mpi4py
(``MPI_Allreduce`` in place, ``MPI_Bcast``, ``MPI_Reduce``, ``MPI_Allgather``,
``MPI_Reduce_scatter_block``, ``MPI_Alltoall``, ``MPI_Gather``, ``MPI_Scatter``, ``MPI_Barrier``;
not through commlib), then each commlib
algorithm through its ``ProcessGroup`` method (rooted collectives: root 0). The contenders of
one size take turns (every iteration calls each once, the first rotating), so drift of a shared
machine hits them alike; every call starts from a fresh copy of the rank-derived input and on a
barrier; a row reports the median over iterations of the slowest rank's time, algbw = size / time, busbw = algbw times
nccl-tests' factor (allreduce 2(P-1)/P; allgather, reduce_scatter, alltoall, gather, scatter
(P-1)/P; broadcast, reduce 1), #wrong = elements that differ from the closed-form result after one more call of the
contender (summed over ranks), and the ratio of the row's time to the MPI library's. ``size`` is the
buffer for allreduce, broadcast and reduce, the whole output for allgather and gather, the whole
input for reduce_scatter, alltoall and scatter (nccl-tests' convention; also what ``"auto"`` is keyed on).
The barrier moves no payload: one row per contender, size, count, algbw and busbw 0, dtype '-'
(the size and dtype options are ignored), and #wrong counts the times a rank left the barrier before a
peer of its host had entered it (:mod:`commlib.bench_barrier`: an arrival board in shared
memory, one rank arriving late each round). ``--floor`` (allreduce) adds the row
``floor:twoshot``: the two-shot's arithmetic and copies alone, no peers, no synchronisation
(:mod:`commlib.bench_floor`), the floor under the shared-memory allreduce on this machine.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from typing import Iterator, List, Optional

import numpy as np
from mpi4py import MPI

from .algorithms import get_algorithm
from .bench_barrier import CHECK_ROUNDS, LATE_SECONDS, BarrierCheck
from .bench_floor import FLOOR_NAME, twoshot_floor
from .benchtools import bus_factor, parse_size, resolve_dtype, time_interleaved
from .ops import ReduceOp

__all__ = ["main", "parse_size", "COLLECTIVES", "BASELINES"]

COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall", "gather", "scatter",
               "barrier")
BASELINES = {"allreduce": "MPI_Allreduce", "broadcast": "MPI_Bcast", "reduce": "MPI_Reduce",
             "allgather": "MPI_Allgather", "reduce_scatter": "MPI_Reduce_scatter_block",
             "alltoall": "MPI_Alltoall", "gather": "MPI_Gather", "scatter": "MPI_Scatter", "barrier": "MPI_Barrier"}
ROOTED = ("broadcast", "reduce", "gather", "scatter")
REDUCING = ("allreduce", "reduce", "reduce_scatter")
ROOT = 0
_COMBINE = {"sum": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m commlib.bench", description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--collective", default="allreduce", choices=COLLECTIVES)
    parser.add_argument("-b", "--min-bytes", type=parse_size, default=8, help="smallest size (default 8)")
    parser.add_argument("-e", "--max-bytes", type=parse_size, default=64 << 20, help="largest size (default 64M)")
    parser.add_argument("-f", "--step-factor", type=int, default=2, help="size multiplier per row (default 2)")
    parser.add_argument("-d", "--dtype", default="float32",
                        help="float16/32/64, bfloat16, int8/32/64, uint8 (default float32)")
    parser.add_argument("-o", "--op", default="sum", choices=sorted(_COMBINE))
    parser.add_argument("-a", "--algorithms", default=None,
                        help="comma-separated commlib algorithms (default: all of the collective's, and auto)")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per row (default 20)")
    parser.add_argument("-w", "--warmup", type=int, default=3, help="untimed iterations per row (default 3)")
    parser.add_argument("-s", "--segment-bytes", type=parse_size, default=None,
                        help="pipeline segment size of the segmented schedules (default: commlib's config)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the MPI library's rows")
    parser.add_argument("--symmetric", action="store_true",
                        help="also time every algorithm with its source in a symmetric buffer (pg.alloc: shared "
                             "memory, read in place by the shm_* algorithms; allreduce and broadcast: the buffer, "
                             "allgather, gather, scatter, alltoall: inp), rows named ALGORITHM@sym")
    parser.add_argument("--symmetric-output", action="store_true",
                        help="with --symmetric, allgather, scatter, alltoall: the output in pg.alloc too, rows "
                             "named ALGORITHM@symio (every buffer of the call in shared memory)")
    parser.add_argument("--floor", action="store_true",
                        help=f"allreduce: also time {FLOOR_NAME!r}, the two-shot's memory work alone on each "
                             f"rank (no peers, no synchronisation: the floor under it; see commlib.bench_floor)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON (rank 0)")
    args = parser.parse_args(argv)
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        parser.error(f"sizes: expected 1 <= min ({args.min_bytes}) <= max ({args.max_bytes})")
    if args.step_factor < 2:
        parser.error(f"--step-factor: expected >= 2, got {args.step_factor}")
    if args.iters < 1 or args.warmup < 0:
        parser.error("--iters must be >= 1 and --warmup >= 0")
    if args.symmetric and args.collective not in SYMMETRIC_COLLECTIVES:
        parser.error(f"--symmetric: only for --collective {', '.join(SYMMETRIC_COLLECTIVES)} (those with "
                     f"shared-memory algorithms that read a symmetric source in place)")
    if args.symmetric_output and (not args.symmetric or args.collective not in SYMMETRIC_OUTPUT_COLLECTIVES):
        parser.error(f"--symmetric-output: only with --symmetric and --collective "
                     f"{', '.join(SYMMETRIC_OUTPUT_COLLECTIVES)} (an output on every rank, apart from the source)")
    if args.floor and args.collective != "allreduce":
        parser.error("--floor: only for --collective allreduce (the two-shot allreduce's floor)")
    return args


def rank_input(rank: int, count: int, dtype, op: str) -> np.ndarray:
    """Small integers (exact in every dtype, summed or multiplied over a few ranks)."""
    index = np.arange(count, dtype=np.int64)
    values = (index + rank) % 2 + 1 if op == "prod" else (index + rank) % 3 + 1
    return values.astype(dtype)


def reduction(size: int, count: int, dtype, op: str) -> np.ndarray:
    total = rank_input(0, count, np.int64, op)
    for rank in range(1, size):
        _COMBINE[op](total, rank_input(rank, count, np.int64, op), out=total)
    return total.astype(dtype)


expected_result = reduction  # the allreduce's result (older name)


def mpi_reduction(dtype, op: str):
    """``(datatype, op)`` for the MPI library's reductions (bfloat16: a numpy user op, MPI has none)."""
    datatype = None
    if dtype.name != "bfloat16":
        try:
            datatype = MPI.Datatype.fromcode(dtype.char)
        except (KeyError, ValueError):
            datatype = None
    if datatype is not None:
        return datatype, {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD}[op]
    datatype = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()
    combine = _COMBINE[op]

    def apply(inbuf, inoutbuf, _datatype):
        out = np.frombuffer(inoutbuf, dtype=dtype)
        combine(np.frombuffer(inbuf, dtype=dtype), out, out=out)

    return datatype, MPI.Op.Create(apply, commute=True)


SYMMETRIC_COLLECTIVES = ("allreduce", "broadcast", "allgather", "gather", "scatter", "alltoall")
SYMMETRIC_OUTPUT_COLLECTIVES = ("allgather", "scatter", "alltoall")


class Setup:
    """One size of one collective: buffers, the calls to time, the check."""

    # --symmetric, allreduce and broadcast: the buffer in pg.alloc (holds the result); the
    # others: the same inp in pg.alloc (symmetric_inp; the result is in target, as without, or
    # with symmetric_output in symmetric)
    symmetric: Optional[np.ndarray] = None
    symmetric_inp: Optional[np.ndarray] = None
    barrier_check: Optional[BarrierCheck] = None  # the barrier's: who left before whom arrived

    def __init__(self, collective, comm, pg, count, dtype, op, symmetric=False, symmetric_output=False):
        self.collective, self.dtype, self.op = collective, dtype, op
        rank, size = comm.Get_rank(), comm.Get_size()
        self.rank, self.size = rank, size
        if collective == "barrier":  # no payload: nothing to reset, the check is the arrival order
            self.count = self.nbytes = 0
            self.target = self.pristine = np.empty(0, dtype)
            self.barrier_check = BarrierCheck(comm)
            self.baseline = comm.Barrier
            self.ours = lambda name: pg.barrier(algorithm=name)
            return
        block = max(1, count // size)
        datatype, mpi_op = mpi_reduction(dtype, op) if collective in REDUCING else (None, None)
        # The enum member, as a program passes it (a string takes the general path: the inline
        # small-message paths test the op by identity).
        commlib_op = ReduceOp.coerce(op)
        if collective in ("allreduce", "broadcast", "reduce"):
            self.count = count
            source = ROOT if collective == "broadcast" else rank
            self.pristine = rank_input(source, count, dtype, op) if collective != "broadcast" or rank == ROOT \
                else np.zeros(count, dtype)
            self.target = np.empty_like(self.pristine)
            self.inp = None
            if collective == "allreduce":
                self.expected = reduction(size, count, dtype, op)
            elif collective == "broadcast":
                self.expected = rank_input(ROOT, count, dtype, op)
            else:
                self.expected = reduction(size, count, dtype, op) if rank == ROOT else self.pristine.copy()
        elif collective == "reduce_scatter":
            self.count = block * size
            self.inp = rank_input(rank, block * size, dtype, op)
            self.target = np.empty(block, dtype)
            self.pristine = np.zeros(block, dtype)
            self.expected = reduction(size, block * size, dtype, op)[rank * block:(rank + 1) * block]
        elif collective == "gather":  # only the root's output is checked
            self.count = block * size
            self.inp = rank_input(rank, block, dtype, op)
            self.target = np.empty(block * size if rank == ROOT else 0, dtype)
            self.pristine = np.zeros_like(self.target)
            self.expected = (np.concatenate([rank_input(r, block, dtype, op) for r in range(size)])
                             if rank == ROOT else self.pristine)
        elif collective == "scatter":
            self.count = block * size
            self.inp = (np.concatenate([rank_input(r, block, dtype, op) for r in range(size)])
                        if rank == ROOT else None)
            self.target = np.empty(block, dtype)
            self.pristine = np.zeros(block, dtype)
            self.expected = rank_input(rank, block, dtype, op)
        elif collective == "allgather":
            self.count = block * size
            self.inp = rank_input(rank, block, dtype, op)
            self.target = np.empty(block * size, dtype)
            self.pristine = np.zeros(block * size, dtype)
            self.expected = np.concatenate([rank_input(r, block, dtype, op) for r in range(size)])
        else:  # alltoall: rank r's block j holds rank_input(r + size * j)
            self.count = block * size
            self.inp = np.concatenate([rank_input(rank + size * j, block, dtype, op) for j in range(size)])
            self.target = np.empty(block * size, dtype)
            self.pristine = np.zeros(block * size, dtype)
            self.expected = np.concatenate([rank_input(i + size * rank, block, dtype, op) for i in range(size)])
        self.nbytes = self.count * dtype.itemsize
        target, inp = self.target, self.inp
        byte_view = [target, MPI.BYTE]
        if collective == "allreduce":
            spec = [target, target.size, datatype]
            self.baseline = lambda: comm.Allreduce(MPI.IN_PLACE, spec, mpi_op)
            self.ours = lambda name: pg.allreduce(target, commlib_op, algorithm=name)
            if symmetric:  # the same values in the group's shared memory (collective: every rank allocates)
                sym = self.symmetric = pg.alloc(target.size, dtype)
                self.ours_symmetric = lambda name: pg.allreduce(sym, commlib_op, algorithm=name)
        elif collective == "broadcast":
            self.baseline = lambda: comm.Bcast(byte_view, root=ROOT)
            self.ours = lambda name: pg.broadcast(target, ROOT, algorithm=name)
            if symmetric:
                sym = self.symmetric = pg.alloc(target.size, dtype)
                self.ours_symmetric = lambda name: pg.broadcast(sym, ROOT, algorithm=name)
        elif collective == "reduce":
            spec = [target, target.size, datatype]
            if rank == ROOT:
                self.baseline = lambda: comm.Reduce(MPI.IN_PLACE, spec, mpi_op, root=ROOT)
            else:
                self.baseline = lambda: comm.Reduce(spec, None, mpi_op, root=ROOT)
            self.ours = lambda name: pg.reduce(target, ROOT, commlib_op, algorithm=name)
        elif collective == "allgather":
            self.baseline = lambda: comm.Allgather([inp, MPI.BYTE], byte_view)
            self.ours = lambda name: pg.allgather(target, inp, algorithm=name)
        elif collective == "gather":
            root_out = byte_view if rank == ROOT else None
            self.baseline = lambda: comm.Gather([inp, MPI.BYTE], root_out, root=ROOT)
            self.ours = lambda name: pg.gather(target if rank == ROOT else None, inp, ROOT, algorithm=name)
        elif collective == "scatter":
            root_in = [inp, MPI.BYTE] if rank == ROOT else None
            self.baseline = lambda: comm.Scatter(root_in, byte_view, root=ROOT)
            self.ours = lambda name: pg.scatter(target, inp, ROOT, algorithm=name)
        elif collective == "reduce_scatter":
            self.baseline = lambda: comm.Reduce_scatter_block([inp, block, datatype], [target, block, datatype], mpi_op)
            self.ours = lambda name: pg.reduce_scatter(target, inp, commlib_op, algorithm=name)
        else:
            self.baseline = lambda: comm.Alltoall([inp, MPI.BYTE], byte_view)
            self.ours = lambda name: pg.alltoall(target, inp, algorithm=name)
        if symmetric and collective in ("allgather", "gather", "scatter", "alltoall"):
            # Collective: every rank allocates, also where it has no inp (scatter's non-roots).
            sym_inp = self.symmetric_inp = pg.alloc(block * size if collective in ("scatter", "alltoall") else block,
                                                    dtype)
            if inp is not None:
                np.copyto(sym_inp, inp)
            mine = sym_inp if inp is not None else None
            out = target
            if symmetric_output:  # collective too; reset and checked as target is without it
                out = self.symmetric = pg.alloc(target.size, dtype)
            self.ours_symmetric = {
                "allgather": lambda name: pg.allgather(out, sym_inp, algorithm=name),
                "gather": lambda name: pg.gather(target if rank == ROOT else None, sym_inp, ROOT, algorithm=name),
                "scatter": lambda name: pg.scatter(out, mine, ROOT, algorithm=name),
                "alltoall": lambda name: pg.alltoall(out, sym_inp, algorithm=name),
            }[collective]

    def reset(self) -> None:
        np.copyto(self.target, self.pristine)
        if self.symmetric is not None:
            np.copyto(self.symmetric, self.pristine)

    def wrong(self, symmetric: bool = False) -> int:
        result = self.symmetric if symmetric and self.symmetric is not None else self.target
        return int(np.count_nonzero(result != self.expected))

    def check(self, run, symmetric: bool = False) -> Optional[int]:
        """This rank's wrong count after one more call of ``run`` on fresh inputs (None: unchecked)."""
        if self.barrier_check is not None:
            return self.barrier_check.wrong_after(run)
        self.reset()
        run()
        return self.wrong(symmetric)

    def close(self) -> None:
        if self.barrier_check is not None:
            self.barrier_check.close()


HEADER = (f"{'size':>10} {'count':>10} {'dtype':>8} {'algorithm':>24} {'time(us)':>10} "
          f"{'algbw(GB/s)':>11} {'busbw(GB/s)':>11} {'#wrong':>7} {'ratio':>6}")


def format_row(row: dict) -> str:
    dtype = row["dtype"] or "-"
    wrong = "-" if row["wrong"] is None else row["wrong"]
    return (f"{row['size']:>10} {row['count']:>10} {dtype:>8} {row['algorithm']:>24} "
            f"{row['time_us']:>10.1f} {row['algbw_gbs']:>11.3f} {row['busbw_gbs']:>11.3f} "
            f"{wrong:>7} {row['ratio']:>6.2f}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import commlib

    pg = commlib.init(segment_bytes=args.segment_bytes)
    comm = MPI.COMM_WORLD.Dup()  # the baseline's own communicator, outside commlib
    rank, size = comm.Get_rank(), comm.Get_size()
    collective = args.collective
    dtype = resolve_dtype(args.dtype)
    known = commlib.algorithms(collective) + ["auto"]
    algorithms = [name for name in (args.algorithms or ",".join(known)).split(",") if name]
    unknown = [name for name in algorithms if name not in known]
    if unknown:
        if rank == 0:
            print(f"unknown {collective} algorithm(s) {unknown}: expected some of {sorted(known)}", file=sys.stderr)
        return 2
    # The shared-memory algorithms read the peers' memory: only on a group within one host.
    one_host = pg.host_memory is not None and pg.host_memory.single_host
    unfit = [name for name in algorithms if name != "auto" and not one_host
             and getattr(get_algorithm(name, collective), "requires_shared_memory", False)]
    if unfit and args.algorithms:
        if rank == 0:
            print(f"{', '.join(unfit)}: only within one host with shared memory on; this group "
                  f"spans {pg.topology.host_count} host(s), shared memory "
                  f"{'on' if pg.config.shm else 'off (COMMLIB_SHM=0)'}", file=sys.stderr)
        return 2
    algorithms = [name for name in algorithms if name not in unfit]
    baseline = BASELINES[collective]
    factor = bus_factor(collective, size)
    barrier = collective == "barrier"
    if rank == 0:
        print(f"# commlib {collective} benchmark: {size} ranks"
              + ("" if barrier else f", dtype {dtype.name}")
              + (f", op {args.op}" if collective in REDUCING else "")
              + (f", root {ROOT}" if collective in ROOTED else "")
              + f", segment_bytes {pg.segment_bytes}, {args.iters} iterations (+{args.warmup} warm-up), "
              f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
        if barrier:
            print(f"# time: median over iterations of the slowest rank; no payload (size, algbw, busbw 0); "
                  f"#wrong: exits before a peer of the host had entered, in {CHECK_ROUNDS} more calls with one "
                  f"rank {LATE_SECONDS * 1e3:g} ms late in each; ratio: time / {baseline}'s")
        else:
            print(f"# time: median over iterations of the slowest rank; busbw = algbw x {factor:.3g}; "
                  f"ratio: time / {baseline}'s")
        print(f"# ranks per host: {pg.topology.describe()}")
        print(HEADER, flush=True)
    rows = []
    for nbytes in [0] if barrier else _sizes(args.min_bytes, args.max_bytes, args.step_factor):
        setup = Setup(collective, comm, pg, max(1, nbytes // dtype.itemsize), dtype, args.op, args.symmetric,
                      args.symmetric_output)
        try:
            rows.extend(_measure(setup, comm, pg, baseline, algorithms, args, factor))
        finally:
            setup.close()
    checked = [row["wrong"] for row in rows if row["wrong"] is not None]
    total_wrong = sum(checked)
    if rank == 0:
        verdict = "not checked" if not checked else "OK" if total_wrong == 0 else "FAILED"
        what = "barrier exits before a peer arrived" if barrier else "out of bounds values"
        print(f"# {what}: {total_wrong} {verdict}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)
    comm.Free()
    return 1 if total_wrong else 0


def _sizes(smallest: int, largest: int, factor: int) -> Iterator[int]:
    nbytes = smallest
    while nbytes <= largest:
        yield nbytes
        nbytes *= factor


def _measure(setup: Setup, comm, pg, baseline: str, algorithms, args, factor: float) -> List[dict]:
    """The rows of one size: the contenders timed in turn, then each checked on one more run."""
    rank, size = comm.Get_rank(), comm.Get_size()
    contenders = {} if args.no_baseline else {baseline: setup.baseline}
    contenders.update({name: functools.partial(setup.ours, name) for name in algorithms})
    if args.symmetric:
        suffix = "@symio" if args.symmetric_output else "@sym"
        contenders.update({f"{name}{suffix}": functools.partial(setup.ours_symmetric, name) for name in algorithms})
    if args.floor:
        # On the buffer the reset wrote last (the symmetric one, when there is one), as the
        # collective on it finds it; the push's stand-in for the peers' buffers is the plain
        # one, written by the reset just before (see commlib/bench_floor.py).
        symmetric = setup.symmetric
        push = symmetric is not None
        contenders[FLOOR_NAME] = twoshot_floor(symmetric if symmetric is not None else setup.target,
                                               setup.target if push else setup.pristine, rank, size,
                                               ReduceOp.coerce(setup.op), pg.config.shm_staging_bytes, push=push)
    timings = time_interleaved(comm, contenders, setup.reset, args.iters, args.warmup)
    baseline_time = timings.get(baseline)
    rows = []
    for name, run in contenders.items():
        # Every contender is checked on its own run; None where a rank had nothing to check on.
        on_symmetric = name.endswith(("@sym", "@symio"))
        counts = [None] if name == FLOOR_NAME else comm.allgather(setup.check(run, symmetric=on_symmetric))
        seconds = timings[name]
        algbw = setup.nbytes / seconds / 1e9
        row = dict(collective=setup.collective, size=setup.nbytes, count=setup.count,
                   dtype=None if setup.collective == "barrier" else setup.dtype.name, algorithm=name,
                   time_us=seconds * 1e6, algbw_gbs=algbw, busbw_gbs=algbw * factor,
                   wrong=None if None in counts else sum(counts),
                   ratio=seconds / baseline_time if baseline_time else float("nan"),
                   ranks=size, segment_bytes=pg.segment_bytes, hosts=[list(ranks) for ranks in pg.topology.host_ranks])
        rows.append(row)
        if rank == 0:
            print(format_row(row), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
