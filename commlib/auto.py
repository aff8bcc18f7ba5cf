"""``algorithm="auto"``: pick an allreduce schedule by message size and world size.

The table holds, per world-size class, ``(largest message in bytes, algorithm)`` rows; the first
row whose bound covers the message wins. It was filled from ``python -m commlib.bench`` runs on
the development machine (2 cores, MPICH 5 shared memory, float32, ``-s 256K``, 2026-11-30), taking
at each size the fastest algorithm through ``ProcessGroup.allreduce``:

* ``P = 2``: ``native`` (MPI's ``Iallreduce``) up to 8 MiB; from 16 MiB on, the ring's and
  rabenseifner's cache-sized segments win (64 MiB: rabenseifner 23 ms, MPI 41 ms).
* other powers of two (measured at ``P = 4``, two ranks per core): commlib's polling wait makes
  MPI's nonblocking collective slow when ranks share a core (8 B: ``native`` 2.5 ms,
  ``recursive_doubling`` 0.64 ms), so the latency-optimal schedule takes the small sizes and
  rabenseifner the large ones.
* other world sizes (measured at ``P = 3``, oversubscribed too): the same polling effect; up to
  2 MiB ``recursive_doubling`` (8 B: 0.54 ms against ``native`` 2.5 ms), then the ring, whose
  folded-pair-free schedule was within 1.3x of the best from 4 MiB on (16 MiB: 18.5 ms, best).

If the transport's wait stops monopolising a shared core (see the benchmark notes), re-measure:
at ``P = 4`` a yielding wait made ``native`` the fastest small-message path (8 B: 0.11 ms).

``COMMLIB_ALGO`` overrides the choice for every call that says ``"auto"``. The group skips its
general path for messages up to :func:`native_threshold` (an inline ``MPI_Iallreduce``), so that
function must agree with the table.
"""

from __future__ import annotations

__all__ = ["choose_allreduce", "native_threshold", "world_class"]

MiB = 1 << 20
INF = float("inf")

_TABLE = {
    "2": ((8 * MiB, "native"), (INF, "rabenseifner")),
    "pow2": ((1 * MiB, "recursive_doubling"), (INF, "rabenseifner")),
    "other": ((2 * MiB, "recursive_doubling"), (INF, "ring")),
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
