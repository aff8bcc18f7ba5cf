"""Collective benchmark in the manner of nccl-tests, with the MPI library's own as the baseline.

Run::

    mpiexec -n 4 python -m commlib.bench                              # allreduce, 8 B .. 64 MiB
    mpiexec -n 2 python -m commlib.bench --collective allgather -b 1M -e 64M -f 4 --json out.json
    mpiexec -n 4 python -m commlib.bench --collective broadcast -a binomial,chain,native
    mpiexec -n 2 python -m commlib.bench -a native,ring,shm_oneshot,shm_twoshot,auto --symmetric
    mpiexec -n 4 python -m commlib.bench --collective barrier -n 200

``--collective`` is any collective with a spec in :mod:`commlib.bench.specs` (allreduce by
default; broadcast, reduce, allgather, reduce_scatter, alltoall, alltoallv, gather, scatter,
barrier). This module is the harness, written once for all of them, as nccl-tests' common code
is: for each size it times the MPI library's collective called directly through mpi4py
(``MPI_Allreduce`` in place, ``MPI_Bcast``, ...; not through commlib), then each commlib
algorithm through its ``ProcessGroup`` method (rooted collectives: root 0), and the other kinds
of row the options ask for (:mod:`commlib.bench.rows`). The contenders of one size take turns
(every iteration calls each once, the first rotating), so drift of a shared machine hits them
alike; every call starts from a fresh copy of the rank-derived input and on a barrier
(:mod:`commlib.bench.timing`). A row reports the median over iterations of the slowest rank's
time, algbw = size / time, busbw = algbw times the spec's bus factor, #wrong = what the spec's
check counts after one more call of the contender (summed over ranks; the collectives that move
data: elements that differ from the closed-form result), and the ratio of the row's time to the
MPI library's.

The barrier moves no payload: one row per contender, size, count, algbw and busbw 0, dtype '-'
(the size and dtype options are ignored), and #wrong counts the times a rank left the barrier before a
peer of its host had entered it (:mod:`commlib.bench.barrier_check`: an arrival board in shared
memory, one rank arriving late each round). ``--floor`` (allreduce) adds the row
``floor:twoshot``: the two-shot's arithmetic and copies alone, no peers, no synchronisation
(:mod:`commlib.bench.floor`), the floor under the shared-memory allreduce on this machine.
``--json PATH`` writes the rows in the project's one benchmark format (:mod:`commlib.bench.record`).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Iterator, List, NamedTuple, Optional

from mpi4py import MPI

from commlib.algorithms.registry import get_algorithm
from commlib.bench.floor import FLOOR_NAME
from commlib.bench.group_comm import GroupComm, is_group_comm
from commlib.bench.record import bench_record, write_record
from commlib.bench.rows import COLUMNS, Bench, Case, make_row, row_kinds
from commlib.bench.specs import ROOT, SPECS, CollectiveSpec
from commlib.bench.table import format_line, header_line, names
from commlib.bench.timing import time_interleaved
from commlib.bench.values import COMBINE, mpi_reduction, resolve_dtype
from commlib.errors import InvalidUsageError
from commlib.units import parse_size

__all__ = ["main", "parse_args", "COLLECTIVES", "BASELINES"]

COLLECTIVES = tuple(SPECS)
BASELINES = {name: spec.baseline for name, spec in SPECS.items()}
SYMMETRIC_COLLECTIVES = tuple(name for name, spec in SPECS.items() if spec.symmetric)
SYMMETRIC_OUTPUT_COLLECTIVES = tuple(name for name, spec in SPECS.items() if spec.symmetric == "input+output")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m commlib.bench", description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--collective", default="allreduce", choices=COLLECTIVES)
    parser.add_argument("-b", "--min-bytes", type=parse_size, default=8, help="smallest size (default 8)")
    parser.add_argument("-e", "--max-bytes", type=parse_size, default=64 << 20, help="largest size (default 64M)")
    parser.add_argument("-f", "--step-factor", type=int, default=2, help="size multiplier per row (default 2)")
    parser.add_argument("-d", "--dtype", default="float32",
                        help="float16/32/64, bfloat16, int8/32/64, uint8 (default float32)")
    parser.add_argument("-o", "--op", default="sum", choices=sorted(COMBINE))
    parser.add_argument("-a", "--algorithms", default=None,
                        help="comma-separated commlib algorithms (default: all of the collective's, and auto)")
    parser.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per row (default 20)")
    parser.add_argument("-w", "--warmup", type=int, default=3, help="untimed iterations per row (default 3)")
    parser.add_argument("-s", "--segment-bytes", type=parse_size, default=None,
                        help="pipeline segment size of the segmented schedules (default: commlib's config)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the MPI library's rows")
    parser.add_argument("-t", "--transport", default="default", choices=("default", "sockets"),
                        help="under mpiexec: the measured group over MPI (default) or over commlib's sockets, "
                             "with shared memory within a host (sockets: the baseline is still MPI's, over the "
                             "same links); launched without MPI the group is over sockets either way")
    parser.add_argument("--symmetric", action="store_true",
                        help="also time every algorithm with its source in a symmetric buffer (pg.alloc: shared "
                             "memory, read in place by the shm_* algorithms; allreduce and broadcast: the buffer, "
                             "allgather, gather, scatter, alltoall: inp), rows named ALGORITHM@sym")
    parser.add_argument("--symmetric-output", action="store_true",
                        help="with --symmetric, allgather, scatter, alltoall: the output in pg.alloc too, rows "
                             "named ALGORITHM@symio (every buffer of the call in shared memory)")
    parser.add_argument("--floor", action="store_true",
                        help=f"allreduce: also time {FLOOR_NAME!r}, the two-shot's memory work alone on each "
                             f"rank (no peers, no synchronisation: the floor under it; see commlib.bench.floor)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON (rank 0; commlib.bench.record)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = _parser()
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


def choose_algorithms(pg, collective: str, requested: Optional[str]) -> List[str]:
    """The algorithms to time: ``requested`` (comma-separated) or all of the collective's and auto,
    less the shared-memory ones where the group has none (an error where they were asked for)."""
    import commlib

    known = commlib.algorithms(collective) + ["auto"]
    algorithms = [name for name in (requested or ",".join(known)).split(",") if name]
    unknown = [name for name in algorithms if name not in known]
    if unknown:
        raise InvalidUsageError(f"unknown {collective} algorithm(s) {unknown}: expected some of {sorted(known)}")
    # The shared-memory algorithms read the peers' memory: only on a group within one host.
    one_host = pg.host_memory is not None and pg.host_memory.single_host
    unfit = [name for name in algorithms if name != "auto" and not one_host
             and getattr(get_algorithm(name, collective), "requires_shared_memory", False)]
    if unfit and requested:
        raise InvalidUsageError(f"{', '.join(unfit)}: only within one host with shared memory on; this group "
                                f"spans {pg.topology.host_count} host(s), shared memory "
                                f"{'on' if pg.config.shm else 'off (COMMLIB_SHM=0)'}")
    return [name for name in algorithms if name not in unfit]


def print_preamble(bench: Bench, spec: CollectiveSpec, dtype) -> None:
    """The comment lines above the table (what was run, what the columns mean), and its header."""
    args, pg = bench.args, bench.pg
    print(f"# commlib {spec.name} benchmark: {bench.comm.Get_size()} ranks"
          + (f", dtype {dtype.name}" if spec.payload else "")
          + (f", op {args.op}" if spec.reducing else "")
          + (f", root {ROOT}" if spec.rooted else "")
          + f", segment_bytes {pg.segment_bytes}, {args.iters} iterations (+{args.warmup} warm-up), "
          f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    legend = ["time: median over iterations of the slowest rank",
              f"busbw = algbw x {bench.bus_factor:.3g}" if spec.payload else "no payload (size, algbw, busbw 0)"]
    if spec.check.LEGEND:
        legend.append(f"#wrong: {spec.check.LEGEND}")
    legend.append(f"ratio: time / {spec.baseline}'s" if not args.no_baseline else "ratio: nan (no baseline)")
    print("# " + "; ".join(legend))
    print(f"# {bench.launch}")
    print(f"# ranks per host: {pg.topology.describe()}")
    print(header_line(COLUMNS), flush=True)


def measure(case: Case, bench: Bench) -> List[dict]:
    """The rows of one size: the contenders timed in turn, then each checked on one more call."""
    contenders = {}
    for kind in row_kinds(bench.args):
        contenders.update(kind(case, bench))
    timings = time_interleaved(bench.comm, {name: contender.run for name, contender in contenders.items()},
                               case.reset, bench.args.iters, bench.args.warmup)
    rows = []
    for name, contender in contenders.items():
        # Collective: every rank checks (or none does: whether a row is checked is the same everywhere).
        counts = bench.comm.allgather(case.wrong(contender))
        wrong = None if None in counts else sum(counts)
        row = make_row(case, bench, name, timings[name], wrong, timings.get(case.spec.baseline))
        rows.append(row)
        if bench.comm.Get_rank() == 0:
            print(format_line(COLUMNS, row), flush=True)
    return rows


def _sizes(smallest: int, largest: int, factor: int) -> Iterator[int]:
    nbytes = smallest
    while nbytes <= largest:
        yield nbytes
        nbytes *= factor


def run(bench: Bench, spec: CollectiveSpec, dtype, argv: List[str]) -> int:
    """Every size's rows, the verdict line and the JSON; the exit status (1: something was wrong)."""
    args, comm = bench.args, bench.comm
    if comm.Get_rank() == 0:
        print_preamble(bench, spec, dtype)
    rows = []
    for nbytes in _sizes(args.min_bytes, args.max_bytes, args.step_factor) if spec.payload else [0]:
        case = Case(spec, bench, max(1, nbytes // dtype.itemsize), dtype)
        try:
            rows.extend(measure(case, bench))
        finally:
            case.close()
    checked = [row["#wrong"] for row in rows if row["#wrong"] is not None]
    total_wrong = sum(checked)
    if comm.Get_rank() == 0:
        verdict = "not checked" if not checked else "OK" if total_wrong == 0 else "FAILED"
        print(f"# {spec.check.VERDICT}: {total_wrong} {verdict}", flush=True)
        if args.json:
            write_record(args.json, bench_record("commlib.bench", argv=argv, world_size=comm.Get_size(),
                                                 columns=names(COLUMNS), rows=rows))
    return 1 if total_wrong else 0


def _socket_group(comm, segment_bytes: Optional[int]):
    """``--transport sockets`` under mpiexec: a group whose ranks met over MPI (``comm``) and whose
    bytes go over commlib's sockets (shared memory within a host), so MPI's own collective over the
    same links is the baseline in the same run."""
    from commlib.config import load_config
    from commlib.group.process_group import ProcessGroup
    from commlib.rendezvous.mpi import MPIRendezvous
    from commlib.rendezvous.secret import configured_secret, share_secret
    from commlib.transports.socket import SocketOptions, SocketTransport

    config = load_config()
    rendezvous = MPIRendezvous(comm)
    secret = share_secret(rendezvous, configured_secret(config))
    transport = SocketTransport(rendezvous, secret, options=SocketOptions.from_config(config),
                                timeout=config.timeout, name="bench-sockets")
    return ProcessGroup(transport=transport, timeout=config.timeout, config=config, name="bench-sockets",
                        segment_bytes=segment_bytes)


class Opened(NamedTuple):
    """What :func:`open_bench` sets up: the group to measure, the baseline's communicator, whether
    the group is the benchmark's own (to close), and the launch in words (the preamble's)."""

    pg: Any
    comm: Any
    owns_group: bool
    launch: str


def open_bench(args) -> Opened:
    """Under mpiexec the baseline's communicator is one of its own, outside commlib (and with
    ``--transport sockets`` the measured group is a socket one over it); launched without MPI
    (torchrun, spawn) no MPI library spans the job: the control calls go over the world group
    (:class:`GroupComm`) and there is no baseline."""
    import commlib

    world = commlib.init(segment_bytes=args.segment_bytes)
    if world.comm is None:
        return Opened(world, GroupComm(world), False,
                      "launched without MPI: commlib over sockets (shared memory within a host); no MPI baseline")
    comm = MPI.COMM_WORLD.Dup()
    if args.transport == "sockets":
        return Opened(_socket_group(comm, args.segment_bytes), comm, True,
                      "mpiexec; commlib over sockets (shared memory within a host), MPI over its own links")
    return Opened(world, comm, False, "mpiexec; commlib over MPI")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    opened = open_bench(args)
    pg, comm = opened.pg, opened.comm
    spec = SPECS[args.collective]
    mpi = None
    try:
        try:
            algorithms = choose_algorithms(pg, spec.name, args.algorithms)
        except InvalidUsageError as error:
            if pg.rank == 0:
                print(error, file=sys.stderr)
            return 2
        if is_group_comm(comm):
            args.no_baseline = True
        dtype = resolve_dtype(args.dtype)
        mpi = mpi_reduction(dtype, args.op) if spec.reducing and not args.no_baseline else None
        bench = Bench(comm, pg, args, algorithms, mpi, spec.bus_factor(pg.size) if pg.size > 1 else 1.0,
                      opened.launch)
        return run(bench, spec, dtype, argv)
    finally:
        if mpi is not None:
            mpi.free()
        if opened.owns_group:
            pg.close()
        if not is_group_comm(comm):
            comm.Free()
