"""The small-message fast path of every collective: the transport's native call, right here.

A small collective between ranks of one host takes a few microseconds in the MPI library; the
general path (validation, algorithm lookup, closures, the executor's bookkeeping, the context)
costs more than that. So each collective method first calls its fast path,
``self._<collective>_inline(limit, *args)``, with ``limit`` the largest message (as ``auto``
keys it) that ``algorithm`` runs there: up to where ``"auto"`` means ``"native"``, up to
``INLINE_MAX_BYTES`` for an explicit ``"native"``, -1 (never) for anything else. The fast path
is :meth:`CommExecutor.inline_runner` around the function the transport gave for the
collective (:meth:`~commlib.transports.interface.Transport.inline_native`): two Python calls
in all, since each costs a tenth of the budget. The semantics are the general path's: the
collective takes the next sequence number in issue order (so the ordering rule of
:mod:`commlib.executor` holds), marks the progress board, has the group's timeout as its
deadline, and a failure poisons the group. Anything unusual (a non-contiguous, read-only or GPU
buffer, an unsupported dtype, AVG, a bad root, overlapping buffers, a busy line, debug mode)
returns False, and the general path validates and explains.
"""

from __future__ import annotations

from .auto import native_threshold

__all__ = ["set_up_inline_natives", "INLINE_MAX_BYTES", "INLINE_COLLECTIVES"]

# Largest message (as auto keys it) run inline: it holds the issue lock while it runs, so a
# thread that issues meanwhile waits for it instead of queueing; keep that to microseconds.
INLINE_MAX_BYTES = 64 << 10
INLINE_COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
                      "gather", "scatter", "barrier")


def set_up_inline_natives(group) -> None:
    """Give ``group`` its ``_<collective>_inline`` runners and ``_<collective>_inline_bytes``
    (``{algorithm: limit}``; an algorithm not in it never runs inline).

    allreduce's "auto" limit is the group's to set: it weighs the shared-memory path and the
    hosts too (see ProcessGroup.__init__)."""
    usable = not group.debug and group.size > 1
    for collective in INLINE_COLLECTIVES:
        run = group.transport.inline_native(collective, group.timeout) if usable else None
        if run is None:
            setattr(group, f"_{collective}_inline", _decline)
            setattr(group, f"_{collective}_inline_bytes", {})
            continue
        auto_native = native_threshold(group.size, group.config.algorithm_override_for(collective), collective)
        setattr(group, f"_{collective}_inline", group.executor.inline_runner(run))
        setattr(group, f"_{collective}_inline_bytes",
                {"auto": min(INLINE_MAX_BYTES, auto_native), "native": INLINE_MAX_BYTES})


def _decline(*_args) -> bool:
    """The fast path of a collective the transport has none for: always the general path."""
    return False
