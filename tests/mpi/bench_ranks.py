"""PYTHONPATH=. mpiexec -n 3 python tests/mpi/bench_ranks.py wrong first_round_only ROWS_DIR
PYTHONPATH=. mpiexec -n 2 python tests/mpi/bench_ranks.py ddp ROWS_DIR -- OVERLAP ARGS -- SYNC ARGS

The benchmarks in one job each: what ``tests/mpi/test_bench.py`` reads back.

``wrong``: ``python -m commlib.bench``'s #wrong catches a collective that gets it wrong, and only
that one. Registers a broken barrier (``no_wait`` or ``first_round_only``) and runs the barrier benchmark
with it next to ``native``; then, for every other collective of the benchmark, registers
``off_by_one`` (the native collective, then the last element of rank 0's output changed) and runs
that collective's benchmark with it next to ``native``. Each run writes ``ROWS_DIR/<collective>.json``
(the test reads the rows). Exit status 0 when every run exited 1 (it found the wrong results),
else 1, naming the collectives it missed.

``ddp``: ``python -m ddp.bench OVERLAP ARGS`` then ``python -m ddp.bench --sync SYNC ARGS``, both
through the module's real entry point, in one process: torch starts once (its imports are most of
a small run's time), the rows go to ``ROWS_DIR/ddp.json`` and ``ROWS_DIR/sync.json``.
"""

import runpy
import sys
from pathlib import Path

import commlib
from commlib.algorithms.registry import get_algorithm
from commlib.bench import harness as bench
from commlib.bench.specs import SPECS


def no_wait(transport, *, segment_bytes=1 << 20):
    """Returns at once: every rank is out before the late one has entered."""


def first_round_only(transport, *, segment_bytes=1 << 20):
    """dissemination's distance-1 round alone: a barrier at P=2; at P>=3 rank r hears only from r-1."""
    size, rank = transport.size, transport.rank
    if size == 1:
        return
    token_out = transport.scratch(1, "uint8", slot=1)
    token_in = transport.scratch(1, "uint8", slot=2)
    token_out[...] = 0
    transport.exchange(((token_out, (rank + 1) % size),), ((token_in, (rank - 1) % size),))


def off_by_one(collective):
    """The native ``collective``, then one element of rank 0's output off by one (its first
    buffer argument is the output in every collective's signature; rank 0 has one in all)."""
    native = get_algorithm("native", collective)

    def broken(transport, out, *args, **kwargs):
        native(transport, out, *args, **kwargs)
        if transport.rank == 0 and out is not None and out.size:
            out[-1] += 1

    return broken


def wrong(broken_barrier: str, rows_dir: Path) -> int:
    barriers = {"no_wait": no_wait, "first_round_only": first_round_only}
    commlib.register_algorithm(broken_barrier, barriers[broken_barrier], collective="barrier")
    runs = {"barrier": ["-a", f"{broken_barrier},native", "-n", "3", "-w", "1"]}
    for collective in SPECS:
        if collective != "barrier":
            commlib.register_algorithm("off_by_one", off_by_one(collective), collective=collective)
            runs[collective] = ["-a", "off_by_one,native", "-b", "64", "-e", "64", "-n", "1", "-w", "0", "-d", "int32"]
    missed = [collective for collective, flags in runs.items()
              if bench.main(["--collective", collective, *flags, "--json", str(rows_dir / f"{collective}.json")]) != 1]
    if commlib.init().rank == 0:
        print(f"bench_ranks: wrong results {'missed in ' + ', '.join(missed) if missed else 'caught'} "
              f"for {len(runs)} collectives", flush=True)
    return 1 if missed else 0


def ddp(rows_dir: Path, overlap_args, sync_args) -> int:
    for args, name in ((overlap_args, "ddp.json"), (["--sync", *sync_args], "sync.json")):
        sys.argv = ["ddp.bench", *args, "--json", str(rows_dir / name)]
        runpy.run_module("ddp.bench", run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "wrong":
        sys.exit(wrong(sys.argv[2], Path(sys.argv[3])))
    _, _, rows_dir, *rest = sys.argv
    cut = [index for index, arg in enumerate(rest) if arg == "--"]
    sys.exit(ddp(Path(rows_dir), rest[cut[0] + 1:cut[1]], rest[cut[1] + 1:]))
