"""The small-message fast path of every collective: the transport's own call, right here.

A small collective between ranks of one host takes a few microseconds in the MPI library; the
general path (validation, algorithm lookup, closures, the executor's bookkeeping, the context)
costs more than that. So each collective method first looks up its fast path for the algorithm
asked for, ``self._<collective>_inline.get(algorithm)``, and calls it: a runner
(:meth:`CommExecutor.inline_runner`) around the function the transport gave for the
collective, with the largest message (as ``auto`` keys it) that the algorithm runs there baked
in: for ``"native"`` the library's own collective
(:meth:`~commlib.transports.interface.Transport.inline_native`) up to ``INLINE_MAX_BYTES``;
where the transport has one, our own schedule's single message at two ranks
(:meth:`~commlib.transports.interface.Transport.inline_pair`: ``binomial`` broadcast and
scatter) up to the same; and for ``"auto"`` whichever of the two ``auto`` picks at the smallest
sizes, up to where it stops picking it. Two Python calls in all, since each costs a tenth of
the budget. The semantics are the general path's: the collective takes the next sequence
number in issue order (so the ordering rule of :mod:`commlib.executor` holds), marks the
progress board, has the group's timeout as its deadline, and a failure poisons the group.
Anything unusual (a non-contiguous, read-only or GPU buffer, an unsupported dtype, AVG, a bad
root, overlapping buffers, a busy line, debug mode) returns False, and the general path
validates and explains.
"""

from __future__ import annotations

from .auto import leading_bound

__all__ = ["set_up_inline_natives", "INLINE_MAX_BYTES", "INLINE_COLLECTIVES"]

# Largest message (as auto keys it) run inline: it holds the issue lock while it runs, so a
# thread that issues meanwhile waits for it instead of queueing; keep that to microseconds.
INLINE_MAX_BYTES = 64 << 10
INLINE_COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
                      "gather", "scatter", "barrier")


def set_up_inline_natives(group) -> None:
    """Give ``group`` its ``_<collective>_inline``: ``{algorithm: runner}`` (an algorithm not in
    it never runs inline).

    allreduce's are the group's to make (``group._allreduce_native_run``, None when there is no
    fast path): its "auto" weighs the shared-memory path and the hosts too (see
    ProcessGroup.__init__)."""
    usable = not group.debug and group.size > 1
    transport, runner = group.transport, group.executor.inline_runner
    group._allreduce_native_run = None
    for collective in INLINE_COLLECTIVES:
        fast = {}
        native = transport.inline_native(collective, group.timeout) if usable else None
        if collective == "allreduce":
            group._allreduce_native_run = native
            native = None
        pair = transport.inline_pair(collective, group.timeout) if usable else None  # (algorithm, run)
        runs = ([("native", native)] if native is not None else []) + ([pair] if pair is not None else [])
        override = group.config.algorithm_override_for(collective)
        for algorithm, run in runs:
            fast[algorithm] = runner(run, INLINE_MAX_BYTES)
            auto_bound = leading_bound(group.size, override, collective, algorithm)
            if auto_bound >= 0:
                fast["auto"] = runner(run, min(INLINE_MAX_BYTES, auto_bound))
        setattr(group, f"_{collective}_inline", fast)
