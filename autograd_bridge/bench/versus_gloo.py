"""``dist.all_reduce`` on "commlib" against gloo in one job, under any launcher.

    torchrun --nproc-per-node 2 -m autograd_bridge.bench.versus_gloo                  # 8 B and 64 MiB
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m autograd_bridge.bench.versus_gloo --sizes 16M -a hierarchical,ring --json out.json
    mpiexec -n 2 python -m autograd_bridge.bench.versus_gloo                           # commlib over MPI

Contenders (float32 sum, synchronous): ``gloo`` (``dist.all_reduce`` on a gloo group of the same
ranks), ``commlib`` (``dist.all_reduce`` on the default "commlib" group: ``auto``) and, for each
name in ``-a``, ``commlib:NAME``: the commlib group under the backend called with that algorithm
on the tensor's memory (what ``dist.all_reduce`` runs with ``COMMLIB_ALGO=NAME``, without a job
per algorithm). A sample is ``--calls`` back-to-back calls (default 1) after a barrier of the
commlib group; the contenders take turns sample by sample, the first rotating
(:func:`commlib.bench.timing.time_interleaved`), and a row is the median over samples of the
slowest rank's time per call. One call per sample is the default because the median then drops
the calls during which the shared machine ran something else on a rank's core; a mean over
back-to-back calls (``--calls 100``) keeps them. ``#wrong``: elements off the closed form after one call with
rank-derived inputs, summed over ranks; ``vs gloo``: time / gloo's. ``--json``: the project's one
format (:mod:`commlib.bench.record`).
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

import commlib
from commlib.bench.group_comm import GroupComm
from commlib.bench.record import bench_record, write_record
from commlib.bench.table import Column, format_line, header_line, names
from commlib.bench.timing import time_interleaved
from commlib.platform.launcher import detect_launcher
from commlib.units import parse_size

__all__ = ["main", "COLUMNS"]

COLUMNS = (Column("size", 10, "d"), Column("contender", 22, "s"), Column("calls", 6, "d"),
           Column("time(us)", 12, ".1f"), Column("busbw(GB/s)", 11, ".3f"), Column("#wrong", 7, "d"),
           Column("vs gloo", 8, ".3f"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m autograd_bridge.bench.versus_gloo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,64M", help="comma-separated sizes in bytes (K, M suffixes)")
    parser.add_argument("-a", "--algorithms", default="",
                        help="comma-separated commlib allreduce algorithms, rows commlib:NAME (default: none)")
    parser.add_argument("-n", "--samples", type=int, default=0,
                        help="timed samples per contender (default: 200 up to 1 MiB, 9 above)")
    parser.add_argument("-c", "--calls", type=int, default=1, help="calls per sample (default 1)")
    parser.add_argument("-w", "--warmup", type=int, default=2, help="untimed samples per contender (default 2)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows (rank 0; commlib.bench.record)")
    return parser


def _init() -> None:
    import autograd_bridge

    if detect_launcher() == "mpi":
        autograd_bridge.init_process_group()
    else:  # torchrun, spawn with torch's variables: env://
        dist.init_process_group("commlib")


def _contenders(tensor: torch.Tensor, gloo, algorithms: List[str], calls: int) -> Dict[str, Callable[[], None]]:
    world = commlib.world()
    array = tensor.numpy()

    def repeat(call: Callable[[], object]) -> Callable[[], None]:
        def sample() -> None:
            for _ in range(calls):
                call()
        return sample

    contenders = {"gloo": repeat(lambda: dist.all_reduce(tensor, group=gloo)),
                  "commlib": repeat(lambda: dist.all_reduce(tensor))}
    for name in algorithms:
        contenders[f"commlib:{name}"] = repeat(functools.partial(world.allreduce, array, algorithm=name))
    return contenders


def _wrong(tensor: torch.Tensor, call: Callable[[], None], comm: GroupComm) -> int:
    """Elements off the closed form ``P (P + 1) / 2`` after one call from ``rank + 1``, over ranks."""
    size, rank = comm.Get_size(), comm.Get_rank()
    tensor.fill_(rank + 1)
    call()
    return sum(count or 0 for count in comm.allgather(int((tensor != size * (size + 1) / 2).sum())))


def measure(nbytes: int, gloo, algorithms: List[str], args, comm: GroupComm) -> List[dict]:
    count = max(1, nbytes // 4)
    tensor = torch.zeros(count)
    calls = args.calls
    contenders = _contenders(tensor, gloo, algorithms, calls)
    wrong = {name: _wrong(tensor, call, comm) for name, call in _contenders(tensor, gloo, algorithms, 1).items()}
    samples = args.samples or (200 if nbytes <= 1 << 20 else 9)
    times = time_interleaved(comm, contenders, lambda: tensor.zero_(), samples, args.warmup)
    size = comm.Get_size()
    rows = []
    for name, seconds in times.items():
        per_call = seconds / calls
        rows.append({"size": count * 4, "contender": name, "calls": calls, "time(us)": per_call * 1e6,
                     "busbw(GB/s)": count * 4 / per_call / 1e9 * (2 * (size - 1) / size if size > 1 else 1.0),
                     "#wrong": wrong[name], "vs gloo": seconds / times["gloo"],
                     "hosts": [list(ranks) for ranks in commlib.world().topology.host_ranks]})
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    args = parser.parse_args(argv)
    if args.calls < 1 or args.samples < 0 or args.warmup < 0:
        parser.error("--calls must be >= 1, --samples and --warmup >= 0")
    torch.set_num_threads(1)
    _init()
    gloo = dist.new_group(backend="gloo")
    world = commlib.world()
    comm = GroupComm(world)
    algorithms = [name for name in args.algorithms.split(",") if name]
    known = commlib.algorithms("allreduce") + ["auto"]
    unknown = [name for name in algorithms if name not in known]
    if unknown:
        raise SystemExit(f"unknown allreduce algorithm(s) {unknown}: expected some of {sorted(known)}")
    rank0 = comm.Get_rank() == 0
    if rank0:
        print(f"# dist.all_reduce float32 sum, sync, {world.size} ranks ({world.topology.describe()}); commlib "
              f"{'over MPI' if world.comm is not None else 'over sockets (shared memory within a host)'}; "
              f"torch {torch.__version__}", flush=True)
        print("# time: per call, median over samples of the slowest rank (a sample: 'calls' calls after a barrier); "
              "busbw = algbw x 2(P-1)/P; vs gloo: time / gloo's", flush=True)
        print(header_line(COLUMNS), flush=True)
    rows: List[dict] = []
    for nbytes in (parse_size(text) for text in args.sizes.split(",") if text):
        for row in measure(nbytes, gloo, algorithms, args, comm):
            rows.append(row)
            if rank0:
                print(format_line(COLUMNS, row), flush=True)
    total_wrong = sum(row["#wrong"] for row in rows)
    if rank0:
        print(f"# out of bounds values: {total_wrong} {'OK' if total_wrong == 0 else 'FAILED'}", flush=True)
        if args.json:
            write_record(args.json, bench_record("autograd_bridge.bench.versus_gloo", argv=argv,
                                                 world_size=world.size, columns=names(COLUMNS), rows=rows))
    dist.destroy_process_group()
    return 1 if total_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
