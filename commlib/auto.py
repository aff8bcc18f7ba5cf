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

``COMMLIB_ALGO`` (allreduce) and ``COMMLIB_ALGO_<COLLECTIVE>`` override the choice for every call
that says ``"auto"``. For allreduce, the group skips its general path for messages up to
:func:`native_threshold` (an inline ``MPI_Iallreduce``), so that function must agree with the
table. A choice must depend only on what every rank knows alike (alltoallv's byte counts differ
per rank, so its table has one row).
"""

from __future__ import annotations

__all__ = ["choose", "choose_allreduce", "native_threshold", "world_class"]

KiB = 1 << 10
MiB = 1 << 20
INF = float("inf")

_TABLES = {
    "allreduce": {
        "2": ((8 * MiB, "native"), (INF, "rabenseifner")),
        "pow2": ((4 * MiB, "native"), (INF, "rabenseifner")),
        "other": ((1 * MiB, "native"), (INF, "ring")),
    },
    "broadcast": {
        "2": ((INF, "native"),),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
    "reduce": {
        "2": ((INF, "native"),),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
    "allgather": {
        "2": ((INF, "native"),),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
    "reduce_scatter": {
        "2": ((INF, "native"),),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
    "alltoall": {
        "2": ((INF, "native"),),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
    "alltoallv": {
        "2": ((INF, "native"),),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
    "gather": {
        "2": ((INF, "native"),),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
    "scatter": {
        "2": ((INF, "native"),),
        "pow2": ((INF, "native"),),
        "other": ((INF, "native"),),
    },
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


def native_threshold(world_size: int, override=None) -> int:
    """Largest allreduce (bytes) for which ``"auto"`` means ``"native"`` (-1: never)."""
    if override:
        return INF if override == "native" else -1
    if world_size == 1:
        return INF
    bound = -1
    for upper, name in _TABLES["allreduce"][world_class(world_size)]:
        if name != "native":
            break
        bound = upper
    return bound
