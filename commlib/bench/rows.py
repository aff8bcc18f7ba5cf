"""The rows of one size: a :class:`Case` (one collective's buffers on this rank) and the kinds of
row the harness times on it.

A row kind is a function ``(case, bench) -> {name: Contender}``; the harness joins the kinds the
command line asks for, times every contender in turn and checks each on one more call:

* :func:`baseline_rows`: the MPI library's collective through mpi4py (``--no-baseline``: none);
* :func:`algorithm_rows`: every commlib algorithm asked for, through the group;
* :func:`symmetric_rows`: the same on the buffers in ``pg.alloc`` (``--symmetric``), ``NAME@sym``
  (``NAME@symio`` with ``--symmetric-output``);
* :func:`floor_rows`: ``floor:twoshot`` (``--floor``), not a collective: unchecked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional

import numpy as np

from commlib.bench.floor import FLOOR_NAME, twoshot_floor
from commlib.bench.specs import Buffers, CollectiveSpec, Shape
from commlib.bench.table import Column
from commlib.bench.values import MPIReduction
from commlib.ops import ReduceOp

__all__ = ["COLUMNS", "Bench", "Case", "Contender", "baseline_rows", "algorithm_rows", "symmetric_rows",
           "floor_rows", "row_kinds", "make_row"]

COLUMNS = (Column("size", 10, "d"), Column("count", 10, "d"), Column("dtype", 8, "s"), Column("algorithm", 24, "s"),
           Column("time(us)", 10, ".1f"), Column("algbw(GB/s)", 11, ".3f"), Column("busbw(GB/s)", 11, ".3f"),
           Column("#wrong", 7, "d"), Column("ratio", 6, ".2f"))


@dataclasses.dataclass(frozen=True)
class Bench:
    """What every row of one run shares: the communicators, the options, the algorithms to time."""

    comm: Any               # the baseline's own mpi4py communicator, outside commlib
    pg: Any                 # the commlib group
    args: Any               # the parsed command line
    algorithms: List[str]
    mpi: Optional[MPIReduction]  # the reducing collectives' MPI datatype and op
    bus_factor: float
    launch: str = ""        # how the job was launched and what the group runs over, in words


class Contender(NamedTuple):
    """One row's call, and the buffers its check reads (None: the row is not checked)."""

    run: Callable[[], object]
    buffers: Optional[Buffers]


def on_symmetric(pg, plain: Buffers, kind: str, output: bool) -> Buffers:
    """The same values in ``pg.alloc`` memory: the buffer (in place), or the input (and the output
    with ``output``). ``pg.alloc`` is collective: every rank allocates the same shapes."""
    dtype = plain.pristine.dtype
    if kind == "buffer":
        return dataclasses.replace(plain, out=pg.alloc(plain.out.size, dtype))
    assert plain.inp is not None, kind  # "input": the spec has a separate input
    inp = pg.alloc(plain.inp.size, dtype)
    np.copyto(inp, plain.inp)
    out = pg.alloc(plain.out.size, dtype) if output else plain.out
    return dataclasses.replace(plain, inp=inp, out=out)


class Case:
    """One size of one collective on this rank: its buffers (plain; with ``--symmetric`` also in
    ``pg.alloc``) and the spec's check. Collective (allocation, the check's set-up)."""

    def __init__(self, spec: CollectiveSpec, bench: Bench, requested: int, dtype: np.dtype):
        rank, size = bench.comm.Get_rank(), bench.comm.Get_size()
        self.spec = spec
        self.shape = Shape(rank, size, spec.count(requested, size), dtype, bench.args.op)
        self.nbytes = self.shape.count * dtype.itemsize
        self.plain = spec.init(self.shape)
        self.symmetric: Optional[Buffers] = None
        if bench.args.symmetric:
            self.symmetric = on_symmetric(bench.pg, self.plain, spec.symmetric, bench.args.symmetric_output)
        self.check = spec.check(bench.comm)

    def reset(self) -> None:
        """Fresh inputs before every call: the plain buffer, then the symmetric one (which the floor
        relies on, see :func:`floor_rows`)."""
        self.plain.reset()
        if self.symmetric is not None and self.symmetric.out is not self.plain.out:
            self.symmetric.reset()

    def wrong(self, contender: Contender) -> Optional[int]:
        """This rank's #wrong after one more call of ``contender`` (None: unchecked)."""
        if contender.buffers is None:
            return None
        return self.check.wrong_after(contender.run, contender.buffers)

    def close(self) -> None:
        self.check.close()


def baseline_rows(case: Case, bench: Bench) -> Dict[str, Contender]:
    run = case.spec.run_mpi(bench.comm, case.plain, case.shape, bench.mpi)
    return {case.spec.baseline: Contender(run, case.plain)}


def algorithm_rows(case: Case, bench: Bench) -> Dict[str, Contender]:
    run = case.spec.run(bench.pg, case.plain, case.shape)
    return {name: Contender(functools.partial(run, name), case.plain) for name in bench.algorithms}


def symmetric_rows(case: Case, bench: Bench) -> Dict[str, Contender]:
    assert case.symmetric is not None
    suffix = "@symio" if bench.args.symmetric_output else "@sym"
    run = case.spec.run(bench.pg, case.symmetric, case.shape)
    return {f"{name}{suffix}": Contender(functools.partial(run, name), case.symmetric) for name in bench.algorithms}


def floor_rows(case: Case, bench: Bench) -> Dict[str, Contender]:
    """The two-shot's memory work alone (:mod:`commlib.bench.floor`), on the buffer the reset wrote
    last (the symmetric one, when there is one), as the collective on it finds it. The push's
    stand-in for the peers' buffers is the plain one, written by the reset just before; the pull's
    is the pristine input, read by the reset just before."""
    plain, symmetric = case.plain, case.symmetric
    push = symmetric is not None
    run = twoshot_floor(symmetric.out if symmetric is not None else plain.out,
                        plain.out if push else plain.pristine, case.shape.rank, case.shape.size,
                        ReduceOp.coerce(case.shape.op), bench.pg.config.shm_staging_bytes, push=push)
    return {FLOOR_NAME: Contender(run, None)}


RowKind = Callable[[Case, Bench], Dict[str, Contender]]


def row_kinds(args) -> List[RowKind]:
    """The kinds of row the command line asks for, in the table's order."""
    kinds: List[RowKind] = [] if args.no_baseline else [baseline_rows]
    kinds.append(algorithm_rows)
    if args.symmetric:
        kinds.append(symmetric_rows)
    if args.floor:
        kinds.append(floor_rows)
    return kinds


def make_row(case: Case, bench: Bench, name: str, seconds: float, wrong: Optional[int],
             baseline_seconds: Optional[float]) -> Dict[str, Any]:
    """One row: the table's columns, then the context the JSON keeps (collective, segment size, hosts)."""
    algbw = case.nbytes / seconds / 1e9
    return {"size": case.nbytes, "count": case.shape.count,
            "dtype": case.shape.dtype.name if case.spec.payload else None, "algorithm": name,
            "time(us)": seconds * 1e6, "algbw(GB/s)": algbw, "busbw(GB/s)": algbw * bench.bus_factor,
            "#wrong": wrong, "ratio": seconds / baseline_seconds if baseline_seconds else math.nan,
            "collective": case.spec.name, "segment_bytes": bench.pg.segment_bytes,
            "hosts": [list(ranks) for ranks in bench.pg.topology.host_ranks]}
