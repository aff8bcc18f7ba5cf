"""The small-message fast path of every collective: the transport's native call, right here.

A small collective between ranks of one host takes a few microseconds in the MPI library; the
general path (validation, algorithm lookup, closures, the executor's bookkeeping, the context)
costs more than that. So when ``"auto"`` means ``"native"`` for a small plain numpy buffer (or
the caller asked for ``"native"``), each collective method first tries :meth:`_X_inline`: a
few identity and size tests, then :meth:`CommExecutor.try_run_inline`, which runs the
function the transport gave for it (:meth:`~commlib.transports.interface.Transport.inline_native`)
under the issue lock if nothing else is in line. The semantics are the general path's: the collective takes
the next sequence number in issue order (so the ordering rule of :mod:`commlib.executor`
holds), marks the progress board, has the group's timeout as its deadline, and a failure
poisons the group. Anything unusual (a non-contiguous, read-only or GPU buffer, an unsupported
dtype, AVG, a bad root, overlapping buffers, a busy line, debug mode) returns False, and the
general path validates and explains. Mixed into :class:`commlib.group.ProcessGroup`.
"""

from __future__ import annotations

import numpy as np

from typing import Callable, Dict

from .auto import native_threshold
from .executor import CommExecutor
from .ops import DTYPE_IS_FLOAT, ReduceOp

__all__ = ["InlineNativeMethods", "set_up_inline_natives", "INLINE_MAX_BYTES", "INLINE_COLLECTIVES"]

# The buffers go to the transport as they are (any shape, C-contiguous): MPI takes them whole.
# Largest message (as auto keys it) run inline: it holds the issue lock while it runs, so a
# thread that issues meanwhile waits for it instead of queueing; keep that to microseconds.
INLINE_MAX_BYTES = 64 << 10
INLINE_COLLECTIVES = ("allreduce", "broadcast", "reduce", "allgather", "reduce_scatter", "alltoall",
                      "gather", "scatter", "barrier")
_SUM, _MIN, _MAX = ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX
# The ops whose reduction needs nothing after it (AVG divides), by name; members are matched by
# identity, since hashing an Enum member runs Python code (0.3 us).
_INLINE_OP_NAMES = {"sum": _SUM, "min": _MIN, "max": _MAX, "SUM": _SUM, "MIN": _MIN, "MAX": _MAX}

_NEVER = dict.fromkeys(INLINE_COLLECTIVES, -1)


def set_up_inline_natives(group) -> None:
    """Ask the transport for its inline natives; per collective, the largest ``"auto"`` message
    that takes the fast path (-1: none), and the largest for an explicit ``"native"``."""
    usable = not group.debug and group.size > 1
    group._inline_runs, group._inline_auto_bytes, group._inline_native_bytes = {}, {}, {}
    for collective in INLINE_COLLECTIVES:
        run = group.transport.inline_native(collective, group.timeout) if usable else None
        auto_native = native_threshold(group.size, group.config.algorithm_override_for(collective), collective)
        group._inline_runs[collective] = _no_inline_run if run is None else run
        group._inline_auto_bytes[collective] = -1 if run is None else min(INLINE_MAX_BYTES, auto_native)
        group._inline_native_bytes[collective] = -1 if run is None else INLINE_MAX_BYTES


class InlineNativeMethods:
    # Set by ProcessGroup, which mixes this in (the _inline_* by set_up_inline_natives).
    rank: int
    size: int
    executor: CommExecutor
    _inline_runs: Dict[str, Callable[..., None]]
    _inline_auto_bytes: Dict[str, float]
    _inline_native_bytes: Dict[str, float]

    # Each takes the collective's arguments and ``algorithm`` and runs it if it can (True), or
    # leaves it to the general path (False). The size limit goes first, the auto case inlined:
    # on this path one Python call is a tenth of the budget.
    def _inline_limits(self, algorithm) -> dict:
        """Per collective, the largest message ``algorithm`` (not "auto") runs inline."""
        return self._inline_native_bytes if algorithm == "native" else _NEVER

    def _allreduce_inline(self, buf, op) -> bool:
        """(The allreduce method checked the limit: it has the shared-memory path to weigh too.)"""
        flags = buf.flags
        op = _inline_op(op)
        if not (flags.c_contiguous and flags.writeable) or op is None or buf.dtype not in DTYPE_IS_FLOAT:
            return False
        return self.executor.try_run_inline(self._inline_runs["allreduce"], buf, op)

    def _broadcast_inline(self, buf, root, algorithm) -> bool:
        if buf.__class__ is not np.ndarray or buf.nbytes > (
                self._inline_auto_bytes if algorithm == "auto" else self._inline_limits(algorithm))["broadcast"]:
            return False
        flags = buf.flags
        if (not (flags.c_contiguous and flags.writeable) or root.__class__ is not int
                or not 0 <= root < self.size or buf.dtype not in DTYPE_IS_FLOAT):
            return False
        return self.executor.try_run_inline(self._inline_runs["broadcast"], buf, root)

    def _reduce_inline(self, buf, root, op, algorithm) -> bool:
        if buf.__class__ is not np.ndarray or buf.nbytes > (
                self._inline_auto_bytes if algorithm == "auto" else self._inline_limits(algorithm))["reduce"]:
            return False
        flags = buf.flags
        op = _inline_op(op)
        if (not (flags.c_contiguous and flags.writeable) or root.__class__ is not int
                or not 0 <= root < self.size or op is None or buf.dtype not in DTYPE_IS_FLOAT):
            return False
        return self.executor.try_run_inline(self._inline_runs["reduce"], buf, root, op)

    def _allgather_inline(self, out, inp, algorithm) -> bool:
        if out.__class__ is not np.ndarray or out.nbytes > (
                self._inline_auto_bytes if algorithm == "auto" else self._inline_limits(algorithm))["allgather"]:
            return False
        if not _plain_pair(out, inp) or out.size != self.size * inp.size:
            return False
        return self.executor.try_run_inline(self._inline_runs["allgather"], out, inp)

    def _reduce_scatter_inline(self, out, inp, op, algorithm) -> bool:
        if inp.__class__ is not np.ndarray or inp.nbytes > (
                self._inline_auto_bytes if algorithm == "auto" else self._inline_limits(algorithm))["reduce_scatter"]:
            return False
        op = _inline_op(op)
        if not _plain_pair(out, inp) or inp.size != self.size * out.size or op is None:
            return False
        return self.executor.try_run_inline(self._inline_runs["reduce_scatter"], out, inp, op)

    def _alltoall_inline(self, out, inp, algorithm) -> bool:
        if inp.__class__ is not np.ndarray or inp.nbytes > (
                self._inline_auto_bytes if algorithm == "auto" else self._inline_limits(algorithm))["alltoall"]:
            return False
        if not _plain_pair(out, inp) or out.size != inp.size or inp.size % self.size:
            return False
        return self.executor.try_run_inline(self._inline_runs["alltoall"], out, inp)

    def _gather_inline(self, out, inp, root, algorithm) -> bool:
        if inp.__class__ is not np.ndarray or inp.nbytes * self.size > (
                self._inline_auto_bytes if algorithm == "auto" else self._inline_limits(algorithm))["gather"]:
            return False
        if root.__class__ is not int or not 0 <= root < self.size:
            return False
        if root == self.rank:
            if not _plain_pair(out, inp) or out.size != self.size * inp.size:
                return False
        elif not _plain_input(inp):
            return False
        return self.executor.try_run_inline(self._inline_runs["gather"], out, inp, root)

    def _scatter_inline(self, out, inp, root, algorithm) -> bool:
        if out.__class__ is not np.ndarray or out.nbytes * self.size > (
                self._inline_auto_bytes if algorithm == "auto" else self._inline_limits(algorithm))["scatter"]:
            return False
        if root.__class__ is not int or not 0 <= root < self.size:
            return False
        if root == self.rank:
            if not _plain_pair(out, inp) or inp.size != self.size * out.size:
                return False
        elif not _plain_output(out):
            return False
        return self.executor.try_run_inline(self._inline_runs["scatter"], out, inp, root)

    def _barrier_inline(self, algorithm) -> bool:
        if (self._inline_auto_bytes if algorithm == "auto" else self._inline_limits(algorithm))["barrier"] < 0:
            return False
        return self.executor.try_run_inline(self._inline_runs["barrier"])


def _no_inline_run(*_args) -> None:
    raise AssertionError("no fast path for this collective: its limits are -1, so it is never called")


def _inline_op(op):
    """The ReduceOp for ``op`` if the fast path takes it, else None."""
    if op is _SUM or op is _MAX or op is _MIN:
        return op
    return _INLINE_OP_NAMES.get(op) if op.__class__ is str else None


def _plain_input(inp) -> bool:
    return inp.__class__ is np.ndarray and inp.flags.c_contiguous and inp.dtype in DTYPE_IS_FLOAT


def _plain_output(out) -> bool:
    if out.__class__ is not np.ndarray:
        return False
    flags = out.flags
    return flags.c_contiguous and flags.writeable and out.dtype in DTYPE_IS_FLOAT


def _plain_pair(out, inp) -> bool:
    """Both plain numpy, one supported dtype, usable in place, and apart in memory: two arrays
    that own their data are separate allocations; otherwise numpy's bounds test, and what it
    cannot rule out goes to the general path's exact check."""
    if out.__class__ is not np.ndarray or inp.__class__ is not np.ndarray or out.dtype is not inp.dtype:
        return False
    out_flags, inp_flags = out.flags, inp.flags
    if not (out_flags.c_contiguous and out_flags.writeable and inp_flags.c_contiguous
            and out.dtype in DTYPE_IS_FLOAT):
        return False
    if out_flags.owndata and inp_flags.owndata:
        return out is not inp
    return not np.may_share_memory(out, inp)
