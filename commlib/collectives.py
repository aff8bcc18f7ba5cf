"""``ProcessGroup``'s collectives other than allreduce: validate, pick the algorithm, issue.

Each method checks its arguments in the caller's thread (nothing is sent and no buffer is
written when they are wrong), resolves ``algorithm`` (``"auto"``: :mod:`commlib.auto` or the
``COMMLIB_ALGO_<COLLECTIVE>`` override), and issues one task through the group's ``_issue``,
which runs the algorithm against a transport (see the calling conventions in
:mod:`commlib.algorithms`). Mixed into :class:`commlib.group.ProcessGroup`.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import numpy as np

from . import algorithms as _algorithms
from .errors import InvalidUsageError
from .fingerprint import CallFingerprint
from .ops import ReduceOp, check_op
from .validation import check_buffer, check_counts, check_no_overlap, check_root, check_same_kind

__all__ = ["CollectiveMethods", "algorithm_task"]

_SUM = ReduceOp.SUM
_AVG = ReduceOp.AVG


def algorithm_task(fn, args: tuple, segment_bytes: int, *, average=None, size: int = 1, shared=None):
    """``run(transport)``, the task ``_issue`` runs: algorithm ``fn`` on ``args`` (against the
    shared-memory transport ``shared`` when it needs one), then ``average /= size`` when given
    (AVG, where the algorithm summed).

    A function of its own rather than a closure in each method: a method whose body defines a
    closure creates the cells of every variable the closure captures on each call, before its
    first line, so the small-message fast path at its top paid for them too (10-15 ns each, a
    tenth of a microsecond per collective).
    """
    def run(transport):
        fn(shared or transport, *args, segment_bytes=segment_bytes)
        if average is not None:
            average[...] /= size

    return run


class CollectiveMethods:
    # Provided by ProcessGroup, which mixes this in.
    rank: int
    size: int
    segment_bytes: int
    _issue: Callable[..., Any]
    resolve_algorithm: Callable[..., str]
    _shared_memory_for: Callable[..., Any]
    _is_symmetric: Callable[[Any], bool]
    # The small-message fast paths by algorithm, ``runner(*args) -> ran`` (set by
    # commlib/group_inline.py).
    _broadcast_inline: Dict[str, Callable[..., bool]]
    _reduce_inline: Dict[str, Callable[..., bool]]
    _allgather_inline: Dict[str, Callable[..., bool]]
    _reduce_scatter_inline: Dict[str, Callable[..., bool]]
    _alltoall_inline: Dict[str, Callable[..., bool]]
    _gather_inline: Dict[str, Callable[..., bool]]
    _scatter_inline: Dict[str, Callable[..., bool]]
    _barrier_inline: Dict[str, Callable[..., bool]]

    def broadcast(self, buf, root: int = 0, *, algorithm: str = "auto", async_op: bool = False):
        """Every rank's ``buf`` becomes ``root``'s."""
        fast = self._broadcast_inline.get(algorithm)
        if fast is not None and not async_op and fast(buf, root):
            return None
        flat = check_buffer(buf, "broadcast")
        root = check_root(root, self.size, "broadcast")
        name, fn, shared = self._algorithm("broadcast", algorithm, flat.nbytes, buf)
        run = algorithm_task(fn, (flat, root), self.segment_bytes, shared=shared)
        return self._issue("broadcast", run, flat.nbytes, async_op, buf, name,
                           CallFingerprint(flat.dtype, buf.shape, "", root, name), kind_of=buf)

    def reduce(self, buf, root: int = 0, op=_SUM, *, algorithm: str = "auto", async_op: bool = False):
        """``root``'s ``buf`` becomes the reduction of every rank's; the others' stay as they were."""
        fast = self._reduce_inline.get(algorithm)
        if fast is not None and not async_op and fast(buf, root, op):
            return None
        op = ReduceOp.coerce(op)
        flat = check_buffer(buf, "reduce")
        check_op(op, flat.dtype, "reduce")
        root = check_root(root, self.size, "reduce")
        name, fn, shared = self._algorithm("reduce", algorithm, flat.nbytes, buf)
        combine = _SUM if op is _AVG else op
        run = algorithm_task(fn, (flat, root, combine), self.segment_bytes, shared=shared,
                             average=flat if op is _AVG and self.rank == root else None, size=self.size)
        return self._issue("reduce", run, flat.nbytes, async_op, buf, name,
                           CallFingerprint(flat.dtype, buf.shape, op.name, root, name), kind_of=buf)

    def allgather(self, out, inp, *, algorithm: str = "auto", async_op: bool = False):
        """``out`` (``size * inp.size``) gets every rank's ``inp``, rank-major."""
        fast = self._allgather_inline.get(algorithm)
        if fast is not None and not async_op and fast(out, inp):
            return None
        flat_out, flat_inp = self._out_and_inp("allgather", out, inp)
        self._check_size("allgather", "out", flat_out.size, "inp", flat_inp.size)
        name, fn, shared = self._algorithm("allgather", algorithm, flat_out.nbytes, out, (flat_out, flat_inp))
        run = algorithm_task(fn, (flat_out, flat_inp), self.segment_bytes, shared=shared)
        return self._issue("allgather", run, flat_out.nbytes, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, inp.shape, "", -1, name), kind_of=out)

    def reduce_scatter(self, out, inp, op=_SUM, *, algorithm: str = "auto", async_op: bool = False):
        """Rank ``r``'s ``out`` gets block ``r`` of the reduction of every rank's ``inp``."""
        fast = self._reduce_scatter_inline.get(algorithm)
        if fast is not None and not async_op and fast(out, inp, op):
            return None
        op = ReduceOp.coerce(op)
        flat_out, flat_inp = self._out_and_inp("reduce_scatter", out, inp)
        check_op(op, flat_out.dtype, "reduce_scatter")
        self._check_size("reduce_scatter", "inp", flat_inp.size, "out", flat_out.size)
        name, fn, shared = self._algorithm("reduce_scatter", algorithm, flat_inp.nbytes, out)
        combine = _SUM if op is _AVG else op
        run = algorithm_task(fn, (flat_out, flat_inp, combine), self.segment_bytes, shared=shared,
                             average=flat_out if op is _AVG else None, size=self.size)
        return self._issue("reduce_scatter", run, flat_inp.nbytes, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, inp.shape, op.name, -1, name), kind_of=out)

    def alltoall(self, out, inp, *, algorithm: str = "auto", async_op: bool = False):
        """Block ``j`` of rank ``i``'s ``inp`` lands in block ``i`` of rank ``j``'s ``out`` (equal blocks)."""
        fast = self._alltoall_inline.get(algorithm)
        if fast is not None and not async_op and fast(out, inp):
            return None
        flat_out, flat_inp = self._out_and_inp("alltoall", out, inp)
        if flat_out.size != flat_inp.size or flat_inp.size % self.size:
            raise InvalidUsageError(
                f"alltoall: inp has {flat_inp.size} and out {flat_out.size} elements; expected the same "
                f"size, a multiple of the world size {self.size} (one equal block per rank; alltoallv "
                f"takes unequal ones)")
        name, fn, shared = self._algorithm("alltoall", algorithm, flat_inp.nbytes, out, (flat_out, flat_inp))
        run = algorithm_task(fn, (flat_out, flat_inp), self.segment_bytes, shared=shared)
        return self._issue("alltoall", run, flat_inp.nbytes, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, inp.shape, "", -1, name), kind_of=out)

    def alltoallv(self, out, inp, out_counts, in_counts, *, algorithm: str = "auto", async_op: bool = False):
        """``in_counts[j]`` elements of ``inp`` go to rank ``j``, ``out_counts[i]`` arrive from rank ``i``.

        Blocks are consecutive in rank order. Before any data moves, the ranks exchange their
        counts (a small synchronous collective, also with ``async_op``) so that counts that do
        not match raise :class:`InvalidUsageError` on every rank, naming the pairs.
        """
        flat_out, flat_inp = self._out_and_inp("alltoallv", out, inp)
        out_counts = check_counts(out_counts, self.size, "alltoallv", "out_counts", flat_out.size, "out")
        in_counts = check_counts(in_counts, self.size, "alltoallv", "in_counts", flat_inp.size, "inp")
        name, fn, shared = self._algorithm("alltoallv", algorithm, 0, out)
        self._agree_on_counts(out_counts, in_counts)
        run = algorithm_task(fn, (flat_out, flat_inp, out_counts, in_counts), self.segment_bytes, shared=shared)
        return self._issue("alltoallv", run, flat_inp.nbytes, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, ("v",), "", -1, name), kind_of=out)

    def gather(self, out, inp, root: int = 0, *, algorithm: str = "auto", async_op: bool = False):
        """``root``'s ``out`` (``size * inp.size``) gets every rank's ``inp``; elsewhere ``out`` may be None."""
        fast = self._gather_inline.get(algorithm)
        if fast is not None and not async_op and fast(out, inp, root):
            return None
        root = check_root(root, self.size, "gather")
        flat_inp = check_buffer(inp, "gather", "inp", writable=False)
        flat_out = None
        if self.rank == root:
            flat_out, flat_inp = self._out_and_inp("gather", out, inp, needed_on=f"the root (rank {root})")
            self._check_size("gather", "out", flat_out.size, "inp", flat_inp.size)
        name, fn, shared = self._algorithm("gather", algorithm, flat_inp.nbytes * self.size, inp)
        run = algorithm_task(fn, (flat_out, flat_inp, root), self.segment_bytes, shared=shared)
        return self._issue("gather", run, flat_inp.nbytes * self.size, async_op, out, name,
                           CallFingerprint(flat_inp.dtype, inp.shape, "", root, name), kind_of=inp)

    def scatter(self, out, inp, root: int = 0, *, algorithm: str = "auto", async_op: bool = False):
        """Rank ``r``'s ``out`` gets block ``r`` of ``root``'s ``inp``; elsewhere ``inp`` may be None."""
        fast = self._scatter_inline.get(algorithm)
        if fast is not None and not async_op and fast(out, inp, root):
            return None
        root = check_root(root, self.size, "scatter")
        flat_out = check_buffer(out, "scatter", "out")
        flat_inp = None
        if self.rank == root:
            flat_out, flat_inp = self._out_and_inp("scatter", out, inp, needed_on=f"the root (rank {root})")
            self._check_size("scatter", "inp", flat_inp.size, "out", flat_out.size)
        name, fn, shared = self._algorithm("scatter", algorithm, flat_out.nbytes * self.size, out)
        run = algorithm_task(fn, (flat_out, flat_inp, root), self.segment_bytes, shared=shared)
        return self._issue("scatter", run, flat_out.nbytes * self.size, async_op, out, name,
                           CallFingerprint(flat_out.dtype, out.shape, "", root, name), kind_of=out)

    def barrier(self, *, algorithm: str = "auto", async_op: bool = False):
        """Returns once every rank of the group has entered the barrier."""
        fast = self._barrier_inline.get(algorithm)
        if fast is not None and not async_op and fast():
            return None
        name, fn, shared = self._algorithm("barrier", algorithm, 0, None)
        run = algorithm_task(fn, (), self.segment_bytes, shared=shared)
        return self._issue("barrier", run, 0, async_op, None, name, CallFingerprint(None, (), "", -1, name))

    # -- shared checks -------------------------------------------------------------------------
    def _algorithm(self, collective: str, algorithm, nbytes: int, buf, everything=()):
        """``(name, fn, shared)``: the algorithm to run, and the shared-memory transport it needs
        (None for the others; InvalidUsageError where it cannot have one). ``everything``: every
        buffer of the call, where ``"auto"`` chooses by whether all of them are symmetric."""
        on_gpu = buf is not None and buf.__class__ is not np.ndarray
        symmetric = algorithm == "auto" and bool(everything) and all(map(self._is_symmetric, everything))
        name = self.resolve_algorithm(algorithm, nbytes, on_gpu, collective=collective, symmetric=symmetric)
        fn = _algorithms.get_algorithm(name, collective)
        if getattr(fn, "requires_shared_memory", False):
            return name, fn, self._shared_memory_for(name, buf, collective)
        return name, fn, None

    def _out_and_inp(self, collective: str, out, inp, needed_on: str = ""):
        for name, buf in (("out", out), ("inp", inp)):
            if buf is None:
                raise InvalidUsageError(f"{collective}: {name} is None; expected an array"
                                        + (f" on {needed_on}" if needed_on else ""))
        flat_out = check_buffer(out, collective, "out")
        flat_inp = check_buffer(inp, collective, "inp", writable=False)
        check_same_kind(collective, out=out, inp=inp)
        check_no_overlap(collective, flat_out, flat_inp)
        return flat_out, flat_inp

    def _check_size(self, collective: str, big: str, big_size: int, small: str, small_size: int) -> None:
        if big_size != self.size * small_size:
            raise InvalidUsageError(
                f"{collective}: {big} has {big_size} elements; expected world size {self.size} x "
                f"{small}.size {small_size} = {self.size * small_size}")

    def _agree_on_counts(self, out_counts, in_counts) -> None:
        """Every rank sees every rank's counts; any mismatch raises the same error everywhere."""
        size = self.size
        mine = np.array(out_counts + in_counts, np.int64)
        everyone = mine
        if size > 1:
            everyone = np.empty(2 * size * size, np.int64)

            def run(transport):  # never raises: all ranks decide alike, and the group stays usable
                transport.native_allgather(everyone, mine)

            self._issue("alltoallv_counts", run, everyone.nbytes, False, None, "native",
                        CallFingerprint(mine.dtype, mine.shape, "", -1, "native"))
        table = everyone.reshape(size, 2, size)  # [rank, out/in, peer]
        wrong = [f"rank {sender} sends {table[sender, 1, receiver]} to rank {receiver}, which expects "
                 f"{table[receiver, 0, sender]}"
                 for sender in range(size) for receiver in range(size)
                 if table[sender, 1, receiver] != table[receiver, 0, sender]]
        if wrong:
            shown = "; ".join(wrong[:8]) + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else "")
            raise InvalidUsageError(f"alltoallv: rank {self.rank}: the ranks' counts disagree (in_counts[j] "
                                    f"of rank i must equal out_counts[i] of rank j): {shown}")
