"""``algorithm="auto"``: pick an allreduce schedule by message size and world size.

The thresholds come from ``python -m commlib.bench`` runs on the development machine (2 cores,
MPICH shared memory, float32); see the README's benchmark table. ``COMMLIB_ALGO`` overrides the
choice for every call that says ``"auto"``.
"""

from __future__ import annotations

__all__ = ["choose_allreduce", "native_threshold"]

# (upper bound in bytes, algorithm) per world-size class, first match wins.
SMALL_MESSAGE_BYTES = 64 << 10

_TABLE = {
    "pow2": ((SMALL_MESSAGE_BYTES, "native"), (float("inf"), "ring")),
    "other": ((SMALL_MESSAGE_BYTES, "native"), (float("inf"), "ring")),
}


def choose_allreduce(nbytes: int, world_size: int, available) -> str:
    if world_size == 1:
        return "native"
    table = _TABLE["pow2" if world_size & (world_size - 1) == 0 else "other"]
    for bound, name in table:
        if nbytes <= bound:
            return name if name in available else "native"
    return "native"


def native_threshold(world_size: int, override=None) -> int:
    """Largest message (bytes) for which ``"auto"`` means ``"native"`` (-1: never)."""
    if override:
        return float("inf") if override == "native" else -1
    if world_size == 1:
        return float("inf")
    table = _TABLE["pow2" if world_size & (world_size - 1) == 0 else "other"]
    bound = -1
    for upper, name in table:
        if name != "native":
            break
        bound = upper
    return bound
