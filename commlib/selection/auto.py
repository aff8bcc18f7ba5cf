"""``algorithm="auto"``: pick each collective's schedule by message size and world size.

Each collective has a table holding, per world-size class (2 ranks, other powers of two, the
rest), ``(largest message in bytes, algorithm)`` rows; the first row whose bound covers the
message wins. The message size is the byte count the benchmark reports for that collective
(``python -m commlib.bench --collective NAME``): the buffer for broadcast, reduce and allreduce,
the whole output for allgather and gather, the whole input for reduce_scatter, alltoall and
scatter. Each bound is where, in the benchmark runs through the ``ProcessGroup`` method on the
development machine (2 cores, MPICH 5 shared memory, float32), one algorithm stopped being the
fastest; the runs of P = 2 and 4 are the data in ``docs/benchmarks/``
(``collectives-<collective>-p2`` and ``-p4``, rendered in ``docs/benchmarks.md``). The rows of
the "other" class (P = 3) came from runs that are not checked in: ``mpiexec -n 3 python -m
commlib.bench --collective NAME -b 16 -e 64M -f 4 --json docs/benchmarks/collectives-NAME-p3.json``
makes them. At P = 3 and 4 on 2 cores the ranks are oversubscribed: the rows describe that
machine, not a rule; measure yours and override.

Two patterns recur, and explain most rows: below ~64 KiB the library's own ("native") wins,
because our schedules pay the Python path once per message and the library once per call; and
above a few MiB the schedules whose segments stay in cache (ring, rabenseifner, pairwise, flat)
beat the library's.

``COMMLIB_ALGO`` (allreduce) and ``COMMLIB_ALGO_<COLLECTIVE>`` override the choice for every call
that says ``"auto"``. For allreduce, the group skips its general path for messages up to
:func:`native_threshold` (an inline ``MPI_Iallreduce``), so that function must agree with the
table; the other collectives' small-message fast paths (:mod:`commlib.group.fast_path`) ask it too.
A choice must depend only on what every rank knows alike (alltoallv's byte counts differ
per rank, so its table has one row).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

__all__ = ["choose", "choose_allreduce", "native_threshold", "leading_bound", "world_class",
           "choose_shared_memory_allreduce", "shared_memory_inline_bytes", "choose_shared_memory_mover"]

KiB = 1 << 10
MiB = 1 << 20
INF = float("inf")

# (largest message in bytes, INF for no bound; algorithm) rows, in increasing size.
Rows = Tuple[Tuple[float, str], ...]

_TABLES: Dict[str, Dict[str, Rows]] = {
    # Data: docs/benchmarks/collectives-allreduce-p2 and -p4 ("other", P = 3: not checked in, see above).
    "allreduce": {
        "2": ((8 * MiB, "native"), (INF, "rabenseifner")),
        "pow2": ((4 * MiB, "native"), (INF, "rabenseifner")),
        "other": ((1 * MiB, "native"), (INF, "ring")),
    },
    "broadcast": {
        # Two ranks: binomial is one message, which the fast path sends inline up to 64 KiB
        # (fast_path.make_inline_pair) for less than MPI_Bcast costs; above, one transfer either way.
        "2": ((64 * KiB, "binomial"), (INF, "native")),
        "pow2": ((4 * KiB, "native"), (INF, "flat")),
        "other": ((256 * KiB, "native"), (INF, "flat")),
    },
    "reduce": {
        "2": ((64 * KiB, "native"), (INF, "binomial")),
        "pow2": ((4 * KiB, "native"), (1 * MiB, "binomial"), (INF, "rabenseifner")),
        "other": ((1 * MiB, "native"), (INF, "binomial")),
    },
    "allgather": {
        "2": ((INF, "native"),),  # one exchange: nothing to win over the library's
        "pow2": ((256 * KiB, "native"), (16 * MiB, "bruck"), (INF, "ring")),
        "other": ((INF, "native"),),
    },
    "reduce_scatter": {
        "2": ((64 * KiB, "native"), (INF, "ring")),
        "pow2": ((64 * KiB, "native"), (INF, "pairwise")),
        "other": ((256 * KiB, "native"), (INF, "pairwise")),
    },
    "alltoall": {
        # Small messages: the library's MPI_Ialltoall through the group's fast path; above,
        # every transfer in flight at once (scattered) was best or within noise at every P.
        "2": ((32 * KiB, "native"), (INF, "scattered")),
        "pow2": ((32 * KiB, "native"), (INF, "scattered")),
        "other": ((32 * KiB, "native"), (INF, "scattered")),
    },
    "alltoallv": {  # alltoall's schedule; one row, since byte counts differ per rank
        "2": ((INF, "scattered"),),
        "pow2": ((INF, "scattered"),),
        "other": ((INF, "scattered"),),
    },
    "gather": {
        "2": ((INF, "native"),),
        "pow2": ((4 * MiB, "native"), (INF, "binomial")),
        "other": ((INF, "native"),),
    },
    "scatter": {
        "2": ((64 * KiB, "binomial"), (INF, "native")),  # as broadcast's: one message, inline
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
    # The dissemination barrier's rounds cost a Python message each; the library's barrier wins
    # at every P (docs/benchmarks/collectives-barrier-p2, -p4).
    "barrier": {
        "2": ((INF, "native"),),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
}


def world_class(world_size: int) -> str:
    if world_size == 2:
        return "2"
    return "pow2" if world_size & (world_size - 1) == 0 else "other"


def choose(collective: str, nbytes: int, world_size: int, available) -> str:
    """The algorithm ``"auto"`` means for ``collective`` at ``nbytes`` and ``world_size``."""
    if world_size == 1:
        return "native"
    for bound, name in _TABLES[collective][world_class(world_size)]:
        if nbytes <= bound:
            return name if name in available else "native"
    return "native"


def choose_allreduce(nbytes: int, world_size: int, available) -> str:
    return choose("allreduce", nbytes, world_size, available)


def native_threshold(world_size: int, override=None, collective: str = "allreduce") -> float:
    """Largest message (bytes, as the table is keyed) for which ``"auto"`` means ``"native"`` for
    ``collective`` (-1: never); ``override``: the configured algorithm for it, if any."""
    return leading_bound(world_size, override, collective, "native")


def leading_bound(world_size: int, override, collective: str, algorithm: str) -> float:
    """Largest message for which ``"auto"`` means ``algorithm`` from the smallest size on (the
    table's first rows; -1: its first row names another), as the fast paths need it."""
    if override:
        return INF if override == algorithm else -1
    if world_size == 1:
        return INF if algorithm == "native" else -1
    bound: float = -1
    for upper, name in _TABLES[collective][world_class(world_size)]:
        if name != algorithm:
            break
        bound = upper
    return bound


# Groups whose ranks all share one host (and shared memory is on): per world-size class and per
# kind of buffer, (largest message, algorithm) rows as above; None means "the MPI table decides".
# A symmetric buffer (ProcessGroup.alloc) is read in place by shm_twoshot; a plain one has to be
# staged, which costs it the lead over the MPI schedules on large messages (at P = 2 and 3 the
# ring wins there). So the choice depends on the kind of buffer: every rank must pass the same
# kind (debug mode checks it). Small messages go through shm_oneshot's cache-sized slots. Data:
# ``python -m commlib.bench --symmetric``, docs/benchmarks/shm-allreduce-p2 (the symmetric rows);
# the plain-buffer rows and P = 4, 8 come from runs not checked in (``mpiexec -n 4 python -m
# commlib.bench -b 1M -e 64M -f 4 -a ring,shm_twoshot,auto --symmetric --json ...`` makes them).
_SHARED_MEMORY_TABLE: Dict[Tuple[str, bool], Tuple[Tuple[float, Optional[str]], ...]] = {
    ("2", True): ((128 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
    ("2", False): ((8 * MiB, "shm_oneshot"), (INF, None)),
    ("pow2", True): ((256 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
    ("pow2", False): ((256 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
    ("other", True): ((256 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
    ("other", False): ((2 * MiB, "shm_oneshot"), (INF, None)),
}


def choose_shared_memory_allreduce(nbytes: int, world_size: int, symmetric: bool) -> Optional[str]:
    """The shared-memory algorithm ``"auto"`` means on a one-host group, or None (the MPI table)."""
    if world_size == 1:
        return None
    return _first_row(_SHARED_MEMORY_TABLE[(world_class(world_size), bool(symmetric))], nbytes)


def _first_row(rows, nbytes: int) -> Optional[str]:
    """The algorithm of the first row whose bound ``nbytes`` fits under, or None."""
    for bound, name in rows:
        if nbytes <= bound:
            return name
    return None


# The data movers on a one-host group: (collective, world class) -> rows, None: the table above.
# By size only, never by the kind of buffer (shm_direct reads plain and symmetric sources alike),
# so every rank chooses the same; except where every buffer is symmetric (_SYMMETRIC_MOVERS).
# shm_direct copies each byte once, from the peer's pages; it wins from the sizes below at P >= 4,
# where the library's schedules make several passes. At P = 2 and 3 it loses at large broadcasts:
# the staging copy and the readers' copies compete for memory bandwidth. Data: `--collective NAME
# -a native,shm_direct --symmetric`, docs/benchmarks/shm-movers-p2 and -p4 (P = 8 was not checked in).
_SHARED_MEMORY_MOVERS: Dict[Tuple[str, str], Tuple[Tuple[float, Optional[str]], ...]] = {
    ("broadcast", "pow2"): ((512 * KiB, None), (INF, "shm_direct")),
    ("allgather", "pow2"): ((512 * KiB, None), (4 * MiB, "shm_direct"), (INF, None)),
    ("gather", "pow2"): ((256 * KiB - 1, None), (INF, "shm_direct")),
    ("scatter", "pow2"): ((MiB - 1, None), (INF, "shm_direct")),
}


# Every buffer of the call symmetric (allgather, alltoall: source and output in the group's
# shared memory on this rank; see ProcessGroup.alloc): the MPI library's copies from and into
# those shared pages are slower than from private ones, and shm_direct reads the sources in place
# (allgather: pushes into the outputs). At 256 KiB and below the two split or the library's call
# wins, so the rows start above it. As with allreduce, the choice then depends on the buffers:
# every rank must pass the same kind. Data: `--symmetric --symmetric-output`,
# docs/benchmarks/shm-movers-symmetric-p2 and -p4.
_SYMMETRIC_MOVERS: Dict[Tuple[str, str], Tuple[Tuple[float, Optional[str]], ...]] = {
    ("allgather", "2"): ((512 * KiB, None), (INF, "shm_direct")),
    ("allgather", "pow2"): ((512 * KiB, None), (INF, "shm_direct")),
    ("alltoall", "2"): ((512 * KiB, None), (INF, "shm_direct")),
    ("alltoall", "pow2"): ((512 * KiB, None), (INF, "shm_direct")),
}


# With cross-memory attach (agreed by every rank when the group was made, see
# commlib/shm/cross_memory.py), shm_direct's two-rank broadcast, scatter and gather split their
# one copy between the two ranks (half each was the best split): from 1 MiB (scatter: 4 MiB) that
# beats the library's. Data: the split rows of docs/benchmarks/shm-movers-p2.
_CROSS_MEMORY_MOVERS: Dict[Tuple[str, str], Tuple[Tuple[float, Optional[str]], ...]] = {
    ("broadcast", "2"): ((MiB - 1, None), (INF, "shm_direct")),
    ("scatter", "2"): ((4 * MiB - 1, None), (INF, "shm_direct")),
    ("gather", "2"): ((MiB - 1, None), (INF, "shm_direct")),
}


def choose_shared_memory_mover(collective: str, nbytes: int, world_size: int,
                               cross_memory: bool = False, symmetric: bool = False) -> Optional[str]:
    """The shared-memory algorithm ``"auto"`` means for a data mover on a one-host group, or None;
    ``cross_memory``: the group's ranks can copy from each other's private memory; ``symmetric``:
    every buffer of the call lives in the group's shared memory (only allgather and alltoall
    choose by it)."""
    if world_size == 1:
        return None
    key = (collective, world_class(world_size))
    rows = _SYMMETRIC_MOVERS.get(key) if symmetric else None
    if rows is None and cross_memory:
        rows = _CROSS_MEMORY_MOVERS.get(key)
    return _first_row(rows or _SHARED_MEMORY_MOVERS.get(key, ()), nbytes)


def shared_memory_inline_bytes(world_size: int) -> float:
    """Largest message for which ``"auto"`` means ``shm_oneshot`` whatever the buffer (-1: never)."""
    if world_size == 1:
        return -1
    bound = INF
    for symmetric in (True, False):
        rows = _SHARED_MEMORY_TABLE[(world_class(world_size), symmetric)]
        bound = min(bound, rows[0][0] if rows[0][1] == "shm_oneshot" else -1)
    return bound
