"""The small-message fast path of every collective: the transport's own call, right here.

A small collective between ranks of one host takes a few microseconds in the MPI library; the
general path (validation, algorithm lookup, closures, the executor's bookkeeping, the context)
costs more than that. So each collective method first looks up its fast path for the algorithm
asked for in a table built once per group (:func:`build_fast_paths`) and calls it: a runner
(:meth:`CommExecutor.inline_runner`) around the function the transport gave for the
collective, with the largest message (as ``auto`` keys it) that the algorithm runs there baked
in: for ``"native"`` the library's own collective
(:meth:`~commlib.transports.interface.Transport.inline_native`) up to ``INLINE_MAX_BYTES``;
where the transport has one, our own schedule's single message at two ranks
(:meth:`~commlib.transports.interface.Transport.inline_pair`: ``binomial`` broadcast and
scatter) up to the same; and for ``"auto"`` whichever of the two ``auto`` picks at the smallest
sizes, up to where it stops picking it. Two Python calls in all, since each costs a tenth of
the budget. The semantics are the general path's: the collective takes the next sequence
number in issue order (so the ordering rule of :mod:`commlib.execution.executor` holds), marks
the progress board, has the group's timeout as its deadline, and a failure poisons the group.
Anything unusual (a non-contiguous, read-only or GPU buffer, an unsupported dtype, AVG, a bad
root, overlapping buffers, a busy line, debug mode) returns False, and the general path
validates and explains.

allreduce's table weighs more: on one host with shared memory its small messages take the
shared-memory transport's counters (no library call at all), and across hosts "auto" means the
library's own over a range the across-hosts table (or the cost model) sets.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, NamedTuple, Optional

from commlib.algorithms.registry import algorithm_table
from commlib.selection.across_hosts import native_threshold_across_hosts
from commlib.selection.auto import leading_bound, native_threshold, shared_memory_inline_bytes

__all__ = ["FastPaths", "build_fast_paths", "INLINE_MAX_BYTES", "INLINE_COLLECTIVES"]

# Largest message (as auto keys it) run inline: it holds the issue lock while it runs, so a
# thread that issues meanwhile waits for it instead of queueing; keep that to microseconds.
INLINE_MAX_BYTES = 64 << 10
INLINE_COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
                      "gather", "scatter", "barrier")

Runner = Callable[..., bool]


class FastPaths(NamedTuple):
    """A group's fast paths (see the module docstring)."""

    #: ``{collective: {algorithm: runner}}``; an algorithm not in its table never runs inline.
    by_collective: Dict[str, Dict[str, Runner]]
    #: allreduce through shared-memory counters up to this many bytes (-1: never), and its runner.
    shm_allreduce_bytes: float
    shm_allreduce: Optional[Runner]
    #: Above the inline sizes, the largest allreduce "auto" still hands to the library (-1: none).
    auto_native_bytes: float
    #: Whether the library's allreduce can run inline at all (plain group: no debug, size > 1, a
    #: transport with a library call to run inline).
    native_allreduce_inline: bool


def build_fast_paths(transport, executor, *, size: int, timeout: float, debug: bool, config, topology,
                     shared_memory=None, cost_model=None) -> FastPaths:
    """The fast paths of a group of ``size`` ranks over ``transport`` (``shared_memory``: its
    shared-memory transport when the whole group is on one host)."""
    usable = not debug and size > 1
    runner = executor.inline_runner
    tables: Dict[str, Dict[str, Runner]] = {}
    native_allreduce = None
    for collective in INLINE_COLLECTIVES:
        native = transport.inline_native(collective, timeout) if usable else None
        if collective == "allreduce":  # its "auto" weighs shared memory and hosts: below
            native_allreduce, native = native, None
        pair = transport.inline_pair(collective, timeout) if usable else None  # (algorithm, run)
        runs = ([("native", native)] if native is not None else []) + ([pair] if pair is not None else [])
        override = config.algorithm_override_for(collective)
        fast: Dict[str, Runner] = {}
        for algorithm, run in runs:
            fast[algorithm] = runner(run, INLINE_MAX_BYTES)
            auto_bound = leading_bound(size, override, collective, algorithm)
            if auto_bound >= 0:
                fast["auto"] = runner(run, min(INLINE_MAX_BYTES, auto_bound))
        tables[collective] = fast
    inline_ok = native_allreduce is not None
    auto_native_bytes = native_threshold(size, config.algorithm_override)
    shm_bytes: float = -1
    shm_runner = None
    if shared_memory is not None and not config.algorithm_override and usable:
        # Small messages on one host: counters in shared memory, no MPI call (the transport's
        # slot_round); the library's fast path is left for what "auto" still sends to it.
        shm_bytes = min(shared_memory_inline_bytes(size), shared_memory.layout.slot_bytes)
        auto_native_bytes = -1
        shared_memory.inline_timeout = timeout
        shm_runner = runner(shared_memory.slot_round, shm_bytes)
    if topology.spans_hosts:  # across hosts "auto" has its own table, or a fitted model
        auto_native_bytes = native_threshold_across_hosts(topology, config.algorithm_override, cost_model,
                                                          algorithm_table("allreduce"))
    if native_allreduce is not None:  # "native": inline at any size, as the general path runs it
        tables["allreduce"] = {"native": runner(native_allreduce, math.inf)}
        if auto_native_bytes >= 0:
            tables["allreduce"]["auto"] = runner(native_allreduce, auto_native_bytes)
    return FastPaths(tables, shm_bytes, shm_runner, auto_native_bytes, inline_ok)
