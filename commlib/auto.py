"""``algorithm="auto"``: pick an allreduce schedule by message size and world size.

The table holds, per world-size class, ``(largest message in bytes, algorithm)`` rows; the first
row whose bound covers the message wins. It was filled from ``python -m commlib.bench`` runs on
the development machine (2 cores, MPICH 5 shared memory, float32, 1 MiB segments, 2026-11-30), taking
at each size the fastest algorithm through ``ProcessGroup.allreduce``:

* ``P = 2``: ``native`` (MPI's ``Iallreduce``) up to 8 MiB; from 16 MiB on, the ring's and
  rabenseifner's cache-sized segments win (64 MiB: rabenseifner 23 ms, MPI 41 ms).
* other powers of two (measured at ``P = 4``, two ranks per core, after the transport's wait
  learned to yield the core): ``native`` up to 4 MiB (8 B: 0.13 ms against 0.31-0.60 ms for the
  schedules; 2 MiB: 2.3 ms against rabenseifner's 2.6 ms), rabenseifner above (16 MiB: 20 ms,
  ``native`` 25 ms).
* other world sizes (measured at ``P = 3``): ``native`` up to 1 MiB (256 KiB: 0.31 ms against
  0.49 ms for the best schedule), the ring above (2 MiB: 1.8 ms against ``native`` 3.0 ms;
  16 MiB: 12.9 ms against 17.0 ms).

``COMMLIB_ALGO`` overrides the choice for every call that says ``"auto"``. The group skips its
general path for messages up to :func:`native_threshold` (an inline ``MPI_Iallreduce``), so that
function must agree with the table.
"""

from __future__ import annotations

__all__ = ["choose_allreduce", "native_threshold", "world_class", "choose_shared_memory_allreduce",
           "shared_memory_inline_bytes"]

MiB = 1 << 20
INF = float("inf")

_TABLE = {
    "2": ((8 * MiB, "native"), (INF, "rabenseifner")),
    "pow2": ((4 * MiB, "native"), (INF, "rabenseifner")),
    "other": ((1 * MiB, "native"), (INF, "ring")),
}


def world_class(world_size: int) -> str:
    if world_size == 2:
        return "2"
    return "pow2" if world_size & (world_size - 1) == 0 else "other"


def choose_allreduce(nbytes: int, world_size: int, available) -> str:
    if world_size == 1:
        return "native"
    for bound, name in _TABLE[world_class(world_size)]:
        if nbytes <= bound:
            return name if name in available else "native"
    return "native"


def native_threshold(world_size: int, override=None) -> int:
    """Largest message (bytes) for which ``"auto"`` means ``"native"`` (-1: never)."""
    if override:
        return INF if override == "native" else -1
    if world_size == 1:
        return INF
    bound = -1
    for upper, name in _TABLE[world_class(world_size)]:
        if name != "native":
            break
        bound = upper
    return bound


# Groups whose ranks all share one host (and shared memory is on): (largest message, algorithm)
# rows per world-size class, as above; None means "the MPI table decides". Measured with
# ``python -m commlib.bench`` (see the README's shared-memory table).
_SHARED_MEMORY_TABLE = {
    "2": ((64 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
    "pow2": ((64 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
    "other": ((64 << 10, "shm_oneshot"), (INF, "shm_twoshot")),
}


def choose_shared_memory_allreduce(nbytes: int, world_size: int):
    """The shared-memory algorithm ``"auto"`` means on a one-host group, or None."""
    if world_size == 1:
        return None
    for bound, name in _SHARED_MEMORY_TABLE[world_class(world_size)]:
        if nbytes <= bound:
            return name
    return None


def shared_memory_inline_bytes(world_size: int) -> int:
    """Largest message for which ``"auto"`` means ``shm_oneshot`` on a one-host group (-1: never)."""
    if world_size == 1:
        return -1
    bound = -1
    for upper, name in _SHARED_MEMORY_TABLE[world_class(world_size)]:
        if name != "shm_oneshot":
            break
        bound = upper
    return bound
