"""``algorithm="auto"``: pick each collective's schedule by message size and world size.

Each collective has a table holding, per world-size class, ``(largest message in bytes,
algorithm)`` rows; the first row whose bound covers the message wins. The message size is the
byte count the benchmark reports for that collective (``python -m commlib.bench --collective
NAME``): the buffer for broadcast, reduce and allreduce, the whole output for allgather and
gather, the whole input for reduce_scatter, alltoall and scatter. The tables were filled from
those runs on the development machine (2 cores, MPICH 5 shared memory, float32, 1 MiB segments),
taking at each size the fastest algorithm through the ``ProcessGroup`` method; the measurements
behind them are in the README.

allreduce (2026-11-30):

* ``P = 2``: ``native`` (MPI's ``Iallreduce``) up to 8 MiB; from 16 MiB on, the ring's and
  rabenseifner's cache-sized segments win (64 MiB: rabenseifner 23 ms, MPI 41 ms).
* other powers of two (measured at ``P = 4``, two ranks per core, after the transport's wait
  learned to yield the core): ``native`` up to 4 MiB (8 B: 0.13 ms against 0.31-0.60 ms for the
  schedules; 2 MiB: 2.3 ms against rabenseifner's 2.6 ms), rabenseifner above (16 MiB: 20 ms,
  ``native`` 25 ms).
* other world sizes (measured at ``P = 3``): ``native`` up to 1 MiB (256 KiB: 0.31 ms against
  0.49 ms for the best schedule), the ring above (2 MiB: 1.8 ms against ``native`` 3.0 ms;
  16 MiB: 12.9 ms against 17.0 ms).

The other collectives: see ``_TABLES`` (each row's comment gives the measurement it rests on).
The world-size classes were measured at P = 2, 4 and 3 on 2 cores, so P = 4 and 3 are
oversubscribed: these rows describe this machine, not a rule; measure yours.

``COMMLIB_ALGO`` (allreduce) and ``COMMLIB_ALGO_<COLLECTIVE>`` override the choice for every call
that says ``"auto"``. For allreduce, the group skips its general path for messages up to
:func:`native_threshold` (an inline ``MPI_Iallreduce``), so that function must agree with the
table; the other collectives' small-message fast paths (:mod:`commlib.group_inline`) ask it too.
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
    "allreduce": {
        "2": ((8 * MiB, "native"), (INF, "rabenseifner")),
        "pow2": ((4 * MiB, "native"), (INF, "rabenseifner")),
        "other": ((1 * MiB, "native"), (INF, "ring")),
    },
    # The rest: `python -m commlib.bench --collective NAME -b 16 -e 64M -f 4 -n 12 -w 2` at P = 2,
    # 4 and 3 (2026-12-01, contenders interleaved); ratios are to the MPI library's own blocking
    # call in the same run. Below ~64 KiB the library's own ("native") wins everywhere, except
    # broadcast and scatter at two ranks, where our binomial is one message sent inline (see
    # there): our schedules pay the Python path once per message, the library once per call.
    "broadcast": {
        # Two ranks: binomial is one message, sent inline by the fast path up to 64 KiB
        # (mpi_inline.make_inline_pair; 2026-12-01, -b 8 -e 64K -f 8 -a native,binomial,auto
        # -n 1000: binomial 1.04-1.15 of MPI_Bcast, native 1.29-1.40); above, one transfer, the
        # library's (flat/binomial 1.03-1.06 at >= 4 MiB, native 1.03-1.06)
        "2": ((64 * KiB, "binomial"), (INF, "native")),
        # flat 0.81 at 256 KiB, 0.74 at 1 MiB, 0.79 at 64 MiB; native 0.86/1.09/0.86
        "pow2": ((4 * KiB, "native"), (INF, "flat")),
        # P=3: flat 0.63 at 16 MiB, 0.49 at 64 MiB; native 0.64/0.57
        "other": ((256 * KiB, "native"), (INF, "flat")),
    },
    "reduce": {
        # binomial 0.66 at 256 KiB, 0.49 at 4 MiB, 0.11 at 16 MiB
        "2": ((64 * KiB, "native"), (INF, "binomial")),
        # 16 KiB: 1.84 vs 1.86; 4 MiB: rabenseifner 0.78, binomial 0.85
        "pow2": ((4 * KiB, "native"), (1 * MiB, "binomial"), (INF, "rabenseifner")),
        # P=3, 4 MiB: binomial 0.55, native 1.36; 64 MiB 0.13 vs 0.73
        "other": ((1 * MiB, "native"), (INF, "binomial")),
    },
    "allgather": {
        "2": ((INF, "native"),),  # ring/recursive doubling 1.02-1.06 at >= 4 MiB, native 1.01-1.04
        # 4 MiB: bruck 0.86, native 1.03; 64 MiB: ring 0.91
        "pow2": ((256 * KiB, "native"), (16 * MiB, "bruck"), (INF, "ring")),
        # P=3: native best or within 2% at every size but 4 MiB (bruck 0.88, native 1.06)
        "other": ((INF, "native"),),
    },
    "reduce_scatter": {
        "2": ((64 * KiB, "native"), (INF, "ring")),  # ring 0.69 at 256 KiB, 0.53 at 4 MiB, 0.18 at 64 MiB
        # pairwise 1.02 at 256 KiB (native 1.28), 0.73 at 4 MiB
        "pow2": ((64 * KiB, "native"), (INF, "pairwise")),
        # P=3: pairwise 0.93 at 1 MiB (native 2.75), 0.76 at 64 MiB
        "other": ((256 * KiB, "native"), (INF, "pairwise")),
    },
    "alltoall": {
        # Small messages: the library's MPI_Ialltoall through the group's fast path (2026-12-01,
        # -b 8 -e 256K -f 8 -a native,scattered): up to 32 KiB native 0.92-1.51 of MPI_Alltoall at
        # P=2, 1.25-1.79 at P=3, 1.30-1.71 at P=4, scattered 1.50-3.78; at 256 KiB they tie
        # (P=4: 1.49 vs 1.42). Above, scattered was best or within noise at every size and P
        # (P=4: 0.92 at 4 MiB, 0.76 at 16 MiB), measured when "native" still posted every transfer.
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
        "2": ((INF, "native"),),  # binomial 1.04-1.11 of MPI_Gather at >= 4 MiB, native 1.04-1.09
        "pow2": ((4 * MiB, "native"), (INF, "binomial")),  # 16 MiB: 0.43 vs 0.44; 64 MiB: 0.25 vs 0.33
        "other": ((INF, "native"),),
    },
    "scatter": {  # the library's Iscatter is best or tied at every size and P but small ones at P = 2
        # as broadcast's (same run: binomial 1.16-1.42 of MPI_Scatter up to 4 KiB, 1.05 at 32 KiB;
        # native 1.35-1.56 and 1.19)
        "2": ((64 * KiB, "binomial"), (INF, "native")),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
    # 300 barriers: native 1.25 (P=2), 1.28 (P=4), 1.66 (P=3) of MPI_Barrier's time, dissemination
    # 2.3 / 1.9 / 2.25 (300 interleaved calls each through benchtools.time_interleaved, 2026-12-01)
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
# staged, which costs it the lead over the MPI schedules on large messages. So the choice depends
# on the kind of buffer: every rank must pass the same kind (debug mode checks it). Measured with
# ``python -m commlib.bench --symmetric`` (see the README's shared-memory table).
_SHARED_MEMORY_TABLE: Dict[Tuple[str, bool], Tuple[Tuple[float, Optional[str]], ...]] = {
    # P = 2. Symmetric: 128 KiB oneshot 17 us, twoshot 19 us; 512 KiB 48 against 34 us; 64 MiB
    # twoshot 3.7-3.9 ms, ring 5.0-5.3 ms. Plain: oneshot through the cache-sized slots wins up
    # to 8 MiB (2 MiB: 183 us, ring 258 us, MPI 287 us; 8 MiB: 727 against 742 us for the ring);
    # above, the staged twoshot loses to the ring (64 MiB: 7.3 against 5.2 ms).
    ("2", True): ((128 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
    ("2", False): ((8 * MiB, "shm_oneshot"), (INF, None)),
    # P = 4 and 8 on 2 cores. Symmetric 256 KiB: oneshot 101 / 307 us, twoshot 136 / 346 us. Plain:
    # twoshot from 2 MiB (P=4: 424 against 641 us for oneshot; 16 MiB: 4.8 ms against 6.2 ms for
    # MPI_Allreduce; P=8, 16 MiB: 11.6 against 17.0 ms).
    ("pow2", True): ((256 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
    ("pow2", False): ((256 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
    # P = 3 on 2 cores. Symmetric 256 KiB: oneshot 75 us, twoshot 101 us. Plain 2 MiB: oneshot 466,
    # twoshot 474, ring 685 us; 16 MiB: ring 4.7 ms, oneshot 4.7, twoshot 5.0 ms.
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
# Broadcast, 2026-12-01, `--collective broadcast -a auto,shm_direct` (plain buffers), shm_direct /
# MPI_Bcast: P = 4: 0.53, 0.52, 0.63, 0.72 at 1, 4, 16, 64 MiB (the table's choice 1.02, 0.82,
# 0.72, 0.76 in an earlier run); P = 8: 0.39, 0.56, 0.60 at 1, 4, 16 MiB (the table's 0.76, 0.85,
# 0.68 in the same run). At P = 2 and 3 it lost at 16 MiB (1.27, 1.22): the staging copy and the
# readers' copies compete for memory bandwidth.
# Allgather, `--collective allgather -b 256K -e 16M -a auto,shm_direct`, shm_direct / the
# table's choice, both over MPI_Allgather in the same run: P = 4: 0.91 / 1.33 and 0.86 / 1.11 at 1
# and 4 MiB, 1.15 / 1.03 at 16 MiB; P = 8: 0.97 / 1.64, 0.78 / 1.14, 0.90 / 1.09; at 256 KiB
# 1.81-1.88 / 1.74-1.81.
# Gather and scatter (`-b 256K -e 4M -a auto,shm_direct`, then `-b 4M -e 64M -a
# native,binomial,shm_direct,auto`), shm_direct / the table's choice: gather P = 4: 0.75 / 1.63,
# 0.40 / 1.31, 0.26 / 1.12 at 256 KiB, 1, 4 MiB, 0.26-0.29 / 0.38-0.40 at 16-64 MiB; P = 8: 1.09 /
# 1.55, 0.60 / 1.36, 0.29 / 1.32. Scatter P = 4: 2.08 / 1.92, 0.78 / 1.18, 0.98 / 1.13, then
# 0.63-0.67 / 1.03-1.05 at 4-16 MiB, 0.38 / 1.04 at 64 MiB; P = 8: 2.14 / 2.04, 0.97 / 1.25,
# 0.87 / 1.16.
_SHARED_MEMORY_MOVERS: Dict[Tuple[str, str], Tuple[Tuple[float, Optional[str]], ...]] = {
    ("broadcast", "pow2"): ((512 * KiB, None), (INF, "shm_direct")),
    ("allgather", "pow2"): ((512 * KiB, None), (4 * MiB, "shm_direct"), (INF, None)),
    ("gather", "pow2"): ((256 * KiB - 1, None), (INF, "shm_direct")),
    ("scatter", "pow2"): ((MiB - 1, None), (INF, "shm_direct")),
}


# Every buffer of the call symmetric (allgather, alltoall: source and output in the group's
# shared memory on this rank; see ProcessGroup.alloc): the MPI library's copies from and into
# those shared pages are slower than from private ones, and shm_direct reads the sources in place
# (allgather: pushes into the outputs). Two runs of `--collective allgather|alltoall -a
# auto,shm_direct --symmetric --symmetric-output -b 16K -e 64M -f 4` at P = 2, 4, 8 (2026-12-01),
# shm_direct@symio / auto@symio (the rows above), both over the library's call on private
# buffers in the same run: allgather P = 2: 1.88-2.23 / 1.60-1.92 at 256 KiB, 1.03-1.30 /
# 1.35-1.46 at 1 MiB, 0.67-0.79 / 1.21-1.57 at 4-64 MiB; P = 4 and 8 at 16-64 MiB: 0.58-0.90 /
# 1.29-1.64. Alltoall P = 2: 1.89-2.02 / 1.94-1.99 at 256 KiB, 0.96-1.02 / 1.53 at 1 MiB,
# 0.57-0.90 / 1.24-1.78 at 4-64 MiB; P = 4: 0.82-1.02 / 1.18-1.43 from 1 MiB; P = 8: 0.62-1.15
# / 0.71-1.45 from 1 MiB (4 MiB once 1.01 / 0.95). At 256 KiB and below the two split or the
# library's call wins, so the rows start above it. As with allreduce, the choice then depends on
# the buffers: every rank must pass the same kind.
_SYMMETRIC_MOVERS: Dict[Tuple[str, str], Tuple[Tuple[float, Optional[str]], ...]] = {
    ("allgather", "2"): ((512 * KiB, None), (INF, "shm_direct")),
    ("allgather", "pow2"): ((512 * KiB, None), (INF, "shm_direct")),
    ("alltoall", "2"): ((512 * KiB, None), (INF, "shm_direct")),
    ("alltoall", "pow2"): ((512 * KiB, None), (INF, "shm_direct")),
}


# With cross-memory attach (agreed by every rank when the group was made, see
# commlib/cross_memory.py), shm_direct's two-rank broadcast splits its one copy between the ranks
# from 1 MiB (COOPERATIVE_BYTES): 2026-12-01, a P=2 probe, split / MPI_Bcast: 0.65, 0.87, 0.69,
# 0.78 at 1, 4, 16, 64 MiB with half each (the root's share 0.4: 0.76, 1.11-1.51, 0.66, 0.82-0.85;
# 0.7: 0.85, 0.56, 1.05-1.11, 1.06-1.09).
# Scatter and gather split the same way (`--collective scatter|gather -b 256K -e 64M -a
# native,shm_direct`, plain buffers, shm_direct / the library's): scatter 1.73, 1.20, 0.82, 0.76,
# 0.70 at 256 KiB, 1, 4, 16, 64 MiB; gather 1.50, 0.89, 0.52, 0.72, 0.89.
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
