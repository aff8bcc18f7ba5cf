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


# Groups whose ranks all share one host (and shared memory is on): per world-size class and per
# kind of buffer, (largest message, algorithm) rows as above; None means "the MPI table decides".
# A symmetric buffer (ProcessGroup.alloc) is read in place by shm_twoshot; a plain one has to be
# staged, which costs it the lead over the MPI schedules on large messages. So the choice depends
# on the kind of buffer: every rank must pass the same kind (debug mode checks it). Measured with
# ``python -m commlib.bench --symmetric`` (see the README's shared-memory table).
_SHARED_MEMORY_TABLE = {
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


def choose_shared_memory_allreduce(nbytes: int, world_size: int, symmetric: bool):
    """The shared-memory algorithm ``"auto"`` means on a one-host group, or None (the MPI table)."""
    if world_size == 1:
        return None
    for bound, name in _SHARED_MEMORY_TABLE[(world_class(world_size), bool(symmetric))]:
        if nbytes <= bound:
            return name
    return None


def shared_memory_inline_bytes(world_size: int) -> int:
    """Largest message for which ``"auto"`` means ``shm_oneshot`` whatever the buffer (-1: never)."""
    if world_size == 1:
        return -1
    bound = INF
    for symmetric in (True, False):
        rows = _SHARED_MEMORY_TABLE[(world_class(world_size), symmetric)]
        bound = min(bound, rows[0][0] if rows[0][1] == "shm_oneshot" else -1)
    return bound
