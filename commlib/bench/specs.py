"""One small spec per collective: everything ``python -m commlib.bench`` knows about it.

nccl-tests' ``struct testColl`` is the model: the harness (:mod:`commlib.bench.harness`) is
written once, and a collective is a :class:`CollectiveSpec` in :data:`SPECS`:

* ``count``: the elements a row reports from the elements asked for and the world size ``P``
  (nccl-tests' convention: the buffer for allreduce, broadcast and reduce; the whole output for
  allgather and gather; the whole input for reduce_scatter, alltoall(v) and scatter, rounded
  down to equal blocks of ``count // P``). It is also what ``"auto"`` is keyed on.
* ``bus_factor``: busbw = algbw * bus_factor(P), the per-link traffic of a bandwidth-optimal
  schedule (nccl-tests' PERFORMANCE.md: allreduce 2(P-1)/P; the block collectives (P-1)/P;
  broadcast and reduce 1).
* ``init``: this rank's :class:`Buffers` from rank-derived inputs (:mod:`commlib.bench.values`),
  with the closed-form result the call must leave.
* ``run`` / ``run_mpi``: the call through a :class:`~commlib.ProcessGroup` (``run(algorithm)``)
  and the MPI library's own through mpi4py (the baseline, named ``baseline``).
* ``check``: what #wrong counts; by default the elements that differ from the closed form.

Adding a collective is adding its spec to :data:`SPECS`. A test checks that every collective of
the algorithm registry has one, and that every spec's check catches a wrong result.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Dict, Optional, Protocol, Sequence, Tuple, Type

import numpy as np

from commlib.bench.barrier_check import BarrierCheck
from commlib.bench.values import MPIReduction, rank_input, reduction
from commlib.ops import ReduceOp

__all__ = ["Shape", "Buffers", "Check", "ClosedFormCheck", "CollectiveSpec", "SPECS", "ROOT"]

ROOT = 0  # the rooted collectives' root


@dataclasses.dataclass(frozen=True)
class Shape:
    """One row's parameters on one rank: ``count`` elements as the row reports them."""

    rank: int
    size: int
    count: int
    dtype: np.dtype
    op: str = "sum"

    @property
    def block(self) -> int:
        """One rank's share of ``count`` in the block collectives."""
        return self.count // self.size


@dataclasses.dataclass(frozen=True)
class Buffers:
    """One rank's buffers of one row: ``out`` is what the call writes (in place: what it reads
    too), reset from ``pristine`` before every call; ``expected``, its closed form after one call.
    ``inp``: the separate input (None in place; never written). ``counts``: alltoallv's
    ``(out_counts, in_counts)``."""

    out: np.ndarray
    pristine: np.ndarray
    expected: np.ndarray
    inp: Optional[np.ndarray] = None
    counts: Tuple[Sequence[int], Sequence[int]] = ((), ())

    def reset(self) -> None:
        np.copyto(self.out, self.pristine)

    def wrong(self) -> int:
        return int(np.count_nonzero(self.out != self.expected))


class Check(Protocol):
    """What #wrong counts (a spec's ``check``, built once per size over the benchmark's communicator)."""

    VERDICT: ClassVar[str]  # the summary line's words
    LEGEND: ClassVar[str]   # what #wrong means, where the header must say it ("" where it is plain)

    def __init__(self, comm: Any) -> None:
        """Collective over ``comm`` (an mpi4py communicator)."""

    def wrong_after(self, run: Callable[[], object], buffers: "Buffers") -> Optional[int]:
        """This rank's #wrong after one more call of ``run`` (None: nothing to check on here)."""

    def close(self) -> None:
        """Free what the check set up (local)."""


class ClosedFormCheck:
    """#wrong: the elements of ``out`` that differ from the closed form after one more call."""

    VERDICT: ClassVar[str] = "out of bounds values"  # nccl-tests' words
    LEGEND: ClassVar[str] = ""

    def __init__(self, comm: Any = None) -> None:
        del comm  # the data say it all; nothing to set up

    def wrong_after(self, run: Callable[[], object], buffers: Buffers) -> Optional[int]:
        buffers.reset()
        run()
        return buffers.wrong()

    def close(self) -> None:
        pass


Run = Callable[[str], object]
MPIRun = Callable[[], object]


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
    """A collective as the benchmark sees it (see the module)."""

    name: str
    baseline: str
    bus_factor: Callable[[int], float]
    count: Callable[[int, int], int]
    init: Callable[[Shape], Buffers]
    run: Callable[[Any, Buffers, Shape], Run]
    run_mpi: Callable[[Any, Buffers, Shape, Optional[MPIReduction]], MPIRun]
    check: Type[Check] = ClosedFormCheck
    rooted: bool = False
    reducing: bool = False
    payload: bool = True
    # --symmetric: what goes into pg.alloc: "buffer" (in place), "input", "input+output"
    # (--symmetric-output as well), "" (no shared-memory algorithm reads it in place).
    symmetric: str = ""


def _whole(requested: int, size: int) -> int:
    return requested


def _blocks(requested: int, size: int) -> int:
    return max(1, requested // size) * size


def _one_per_rank(size: int) -> float:
    return (size - 1) / size


def _ranks_concat(ranks, count: int, shape: Shape) -> np.ndarray:
    return np.concatenate([rank_input(r, count, shape.dtype, shape.op) for r in ranks])


def _byte_view(array):
    from mpi4py import MPI

    return [array, MPI.BYTE]


# -- allreduce, broadcast, reduce: one buffer, in place -------------------------------------------

def _allreduce_init(s: Shape) -> Buffers:
    mine = rank_input(s.rank, s.count, s.dtype, s.op)
    return Buffers(np.empty_like(mine), mine, reduction(s.size, s.count, s.dtype, s.op))


def _allreduce_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    assert mpi is not None  # a reducing spec: the harness made one
    from mpi4py import MPI

    spec = [b.out, b.out.size, mpi.datatype]
    return lambda: comm.Allreduce(MPI.IN_PLACE, spec, mpi.op)


def _broadcast_init(s: Shape) -> Buffers:
    sent = rank_input(ROOT, s.count, s.dtype, s.op)
    return Buffers(np.empty_like(sent), sent if s.rank == ROOT else np.zeros_like(sent), sent.copy())


def _reduce_init(s: Shape) -> Buffers:
    mine = rank_input(s.rank, s.count, s.dtype, s.op)
    # Only the root's buffer changes; elsewhere the call must leave the input as it was.
    expected = reduction(s.size, s.count, s.dtype, s.op) if s.rank == ROOT else mine.copy()
    return Buffers(np.empty_like(mine), mine, expected)


def _reduce_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    assert mpi is not None  # a reducing spec: the harness made one
    from mpi4py import MPI

    spec = [b.out, b.out.size, mpi.datatype]
    if s.rank == ROOT:
        return lambda: comm.Reduce(MPI.IN_PLACE, spec, mpi.op, root=ROOT)
    return lambda: comm.Reduce(spec, None, mpi.op, root=ROOT)


# -- the block collectives: a separate input and output -------------------------------------------

def _allgather_init(s: Shape) -> Buffers:
    out = np.zeros(s.count, s.dtype)
    return Buffers(out, out.copy(), _ranks_concat(range(s.size), s.block, s),
                   inp=rank_input(s.rank, s.block, s.dtype, s.op))


def _reduce_scatter_init(s: Shape) -> Buffers:
    out = np.zeros(s.block, s.dtype)
    expected = reduction(s.size, s.count, s.dtype, s.op)[s.rank * s.block:(s.rank + 1) * s.block]
    return Buffers(out, out.copy(), expected, inp=rank_input(s.rank, s.count, s.dtype, s.op))


def _reduce_scatter_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    assert mpi is not None  # a reducing spec: the harness made one
    send, recv = [b.inp, s.block, mpi.datatype], [b.out, s.block, mpi.datatype]
    return lambda: comm.Reduce_scatter_block(send, recv, mpi.op)


def _alltoall_init(s: Shape) -> Buffers:
    """Rank ``r``'s block ``j`` holds ``rank_input(r + P * j)``: every block of the job differs."""
    out = np.zeros(s.count, s.dtype)
    inp = _ranks_concat([s.rank + s.size * j for j in range(s.size)], s.block, s)
    return Buffers(out, out.copy(), _ranks_concat([i + s.size * s.rank for i in range(s.size)], s.block, s), inp=inp)


def alltoallv_count(sender: int, receiver: int, shape: Shape) -> int:
    """Elements ``sender`` sends ``receiver``: a block, half a block more to the right-hand
    neighbour and half a block less to itself, so every rank still sends and receives ``count``."""
    half = shape.block // 2
    step = (receiver - sender) % shape.size
    if shape.size == 1:
        return shape.block
    return shape.block + (half if step == 1 else -half if step == 0 else 0)


def _alltoallv_init(s: Shape) -> Buffers:
    in_counts = [alltoallv_count(s.rank, j, s) for j in range(s.size)]
    out_counts = [alltoallv_count(i, s.rank, s) for i in range(s.size)]
    inp = np.concatenate([rank_input(s.rank + s.size * j, n, s.dtype, s.op) for j, n in enumerate(in_counts)])
    expected = np.concatenate([rank_input(i + s.size * s.rank, n, s.dtype, s.op) for i, n in enumerate(out_counts)])
    out = np.zeros(s.count, s.dtype)
    return Buffers(out, out.copy(), expected, inp=inp, counts=(out_counts, in_counts))


def _alltoallv_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    from mpi4py import MPI

    def layout(counts):
        nbytes = [n * s.dtype.itemsize for n in counts]
        return nbytes, [sum(nbytes[:i]) for i in range(len(nbytes))]

    out_counts, in_counts = b.counts
    send, recv = [b.inp, layout(in_counts), MPI.BYTE], [b.out, layout(out_counts), MPI.BYTE]
    return lambda: comm.Alltoallv(send, recv)


def _gather_init(s: Shape) -> Buffers:
    """Only the root has an output (elsewhere an empty one: nothing to check)."""
    out = np.zeros(s.count if s.rank == ROOT else 0, s.dtype)
    expected = _ranks_concat(range(s.size), s.block, s) if s.rank == ROOT else out.copy()
    return Buffers(out, out.copy(), expected, inp=rank_input(s.rank, s.block, s.dtype, s.op))


def _gather_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    send, recv = _byte_view(b.inp), _byte_view(b.out) if s.rank == ROOT else None
    return lambda: comm.Gather(send, recv, root=ROOT)


def _scatter_init(s: Shape) -> Buffers:
    """Every rank holds an input of the root's shape (so ``--symmetric`` allocates alike on every
    rank); only the root's is passed."""
    out = np.zeros(s.block, s.dtype)
    inp = _ranks_concat(range(s.size), s.block, s) if s.rank == ROOT else np.zeros(s.count, s.dtype)
    return Buffers(out, out.copy(), rank_input(s.rank, s.block, s.dtype, s.op), inp=inp)


def _scatter_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    send, recv = _byte_view(b.inp) if s.rank == ROOT else None, _byte_view(b.out)
    return lambda: comm.Scatter(send, recv, root=ROOT)


def _nothing(s: Shape) -> Buffers:
    empty = np.empty(0, s.dtype)
    return Buffers(empty, empty, empty)


def _op(s: Shape) -> ReduceOp:
    # The enum member, as a program passes it (the small-message fast paths test it by identity).
    return ReduceOp.coerce(s.op)


# -- the calls: buffers and op bound once, so a timed call does nothing but the call ---------------

def _allreduce(pg, b: Buffers, s: Shape) -> Run:
    out, op = b.out, _op(s)
    return lambda name: pg.allreduce(out, op, algorithm=name)


def _broadcast(pg, b: Buffers, s: Shape) -> Run:
    out = b.out
    return lambda name: pg.broadcast(out, ROOT, algorithm=name)


def _broadcast_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    out = _byte_view(b.out)
    return lambda: comm.Bcast(out, root=ROOT)


def _reduce(pg, b: Buffers, s: Shape) -> Run:
    out, op = b.out, _op(s)
    return lambda name: pg.reduce(out, ROOT, op, algorithm=name)


def _allgather(pg, b: Buffers, s: Shape) -> Run:
    out, inp = b.out, b.inp
    return lambda name: pg.allgather(out, inp, algorithm=name)


def _allgather_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    send, recv = _byte_view(b.inp), _byte_view(b.out)
    return lambda: comm.Allgather(send, recv)


def _reduce_scatter(pg, b: Buffers, s: Shape) -> Run:
    out, inp, op = b.out, b.inp, _op(s)
    return lambda name: pg.reduce_scatter(out, inp, op, algorithm=name)


def _alltoall(pg, b: Buffers, s: Shape) -> Run:
    out, inp = b.out, b.inp
    return lambda name: pg.alltoall(out, inp, algorithm=name)


def _alltoall_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    send, recv = _byte_view(b.inp), _byte_view(b.out)
    return lambda: comm.Alltoall(send, recv)


def _alltoallv(pg, b: Buffers, s: Shape) -> Run:
    out, inp, (out_counts, in_counts) = b.out, b.inp, b.counts
    return lambda name: pg.alltoallv(out, inp, out_counts, in_counts, algorithm=name)


def _gather(pg, b: Buffers, s: Shape) -> Run:
    out, inp = (b.out if s.rank == ROOT else None), b.inp
    return lambda name: pg.gather(out, inp, ROOT, algorithm=name)


def _scatter(pg, b: Buffers, s: Shape) -> Run:
    out, inp = b.out, (b.inp if s.rank == ROOT else None)
    return lambda name: pg.scatter(out, inp, ROOT, algorithm=name)


def _barrier(pg, b: Buffers, s: Shape) -> Run:
    return lambda name: pg.barrier(algorithm=name)


def _barrier_mpi(comm, b: Buffers, s: Shape, mpi: Optional[MPIReduction]) -> MPIRun:
    return comm.Barrier


SPECS: Dict[str, CollectiveSpec] = {spec.name: spec for spec in (
    CollectiveSpec("allreduce", "MPI_Allreduce", lambda p: 2 * (p - 1) / p, _whole, _allreduce_init,
                   _allreduce, _allreduce_mpi, reducing=True, symmetric="buffer"),
    CollectiveSpec("broadcast", "MPI_Bcast", lambda p: 1.0, _whole, _broadcast_init,
                   _broadcast, _broadcast_mpi, rooted=True, symmetric="buffer"),
    CollectiveSpec("reduce", "MPI_Reduce", lambda p: 1.0, _whole, _reduce_init,
                   _reduce, _reduce_mpi, rooted=True, reducing=True),
    CollectiveSpec("allgather", "MPI_Allgather", _one_per_rank, _blocks, _allgather_init,
                   _allgather, _allgather_mpi, symmetric="input+output"),
    CollectiveSpec("reduce_scatter", "MPI_Reduce_scatter_block", _one_per_rank, _blocks, _reduce_scatter_init,
                   _reduce_scatter, _reduce_scatter_mpi, reducing=True),
    CollectiveSpec("alltoall", "MPI_Alltoall", _one_per_rank, _blocks, _alltoall_init,
                   _alltoall, _alltoall_mpi, symmetric="input+output"),
    CollectiveSpec("alltoallv", "MPI_Alltoallv", _one_per_rank, _blocks, _alltoallv_init,
                   _alltoallv, _alltoallv_mpi),
    CollectiveSpec("gather", "MPI_Gather", _one_per_rank, _blocks, _gather_init,
                   _gather, _gather_mpi, rooted=True, symmetric="input"),
    CollectiveSpec("scatter", "MPI_Scatter", _one_per_rank, _blocks, _scatter_init,
                   _scatter, _scatter_mpi, rooted=True, symmetric="input+output"),
    # No payload: one row per contender at size 0; #wrong is the order the barrier promises.
    CollectiveSpec("barrier", "MPI_Barrier", lambda p: 0.0, lambda requested, size: 0, _nothing,
                   _barrier, _barrier_mpi, check=BarrierCheck, payload=False),
)}
