"""The MPI library's own collectives (the ``"native"`` algorithms), nonblocking and waited with
the group's deadline.

Each collective has a *starter* (``MPI_Ibcast``, ``MPI_Iallgather``, ...: returns the request,
or None when there is nothing to move) and ``native_<collective>(...)``, the transport
contract's blocking form, which waits for it: the group set the context (sequence number,
deadline) before; the wait yields the core and gives up on a peer that exited
(:func:`commlib.platform.waiting.wait_all`). The group's small-message fast path makes the
same MPI calls through :mod:`.fast_path`, which polls before touching the context at all.

Every byte-moving collective sends raw bytes (``MPI.BYTE``), so bfloat16 travels as well as
any dtype; the reducing ones use a predefined datatype where MPI has one (a user-defined op for
bfloat16, see :mod:`.types`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import numpy as np
from mpi4py import MPI

from commlib.errors import CommTimeoutError, PeerExitedError
from commlib.ops import ReduceOp
from commlib.platform.waiting import wait_all
from commlib.transports.interface import CollectiveContext
from commlib.transports.mpi.types import MPI_PREDEFINED, mpi_datatype, mpi_op

if TYPE_CHECKING:
    from commlib.reliability.progress_board import ProgressBoard

__all__ = ["MPINativeCollectives", "as_bytes", "typed", "reduction", "reduce_scatter_specs", "raise_timeout",
           "TAG_MODULUS"]

_SUM, _MIN, _MAX = ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX
# Point-to-point messages of collective number ``seq`` carry tag ``seq % TAG_MODULUS``
# (MPITransport.tag; the two-rank fast path sends the same, see fast_path.make_inline_pair).
TAG_MODULUS = 32768


def as_bytes(buf):
    """An ``MPI.BYTE`` buffer spec over a contiguous array, without copying."""
    if buf.dtype in MPI_PREDEFINED:  # exports a plain buffer: skip the view (a third of a small Ibcast)
        return [buf, MPI.BYTE]
    return [buf.reshape(-1).view(np.uint8), MPI.BYTE]  # bfloat16: numpy cannot export its format


def typed(buf):
    """A typed buffer spec (for reductions) over a contiguous array, without copying."""
    return [buf.reshape(-1).view(np.uint8), buf.size, mpi_datatype(buf.dtype)]


def reduction(buf, op):
    """(buffer spec, MPI op) for reducing ``buf`` with ``op``; predefined handles when MPI has them."""
    datatype = MPI_PREDEFINED.get(buf.dtype)
    if datatype is not None:
        # Identity tests: hashing an Enum member runs Python code (~0.3 us).
        mpi_reduce_op = MPI.SUM if op is _SUM else MPI.MAX if op is _MAX else MPI.MIN if op is _MIN else None
        if mpi_reduce_op is not None:
            return [buf, buf.size, datatype], mpi_reduce_op
    return typed(buf), mpi_op(buf.dtype, op)


def reduce_scatter_specs(out, inp, op):
    """(send spec, receive spec, MPI op) of ``MPI_Reduce_scatter_block``."""
    spec, mpi_reduce_op = reduction(out, op)
    # mpi4py's send spec for reduce_scatter_block counts one block, not the whole input.
    send = [inp if spec[0] is out else inp.reshape(-1).view(np.uint8), out.size, spec[-1]]
    return send, spec, mpi_reduce_op


class MPINativeCollectives:
    """Mixed into :class:`commlib.transports.mpi.MPITransport`."""

    # Set by the transport that mixes this in.
    comm: MPI.Comm
    rank: int
    context: CollectiveContext
    progress_board: Optional[ProgressBoard]

    # -- starters: the nonblocking MPI call, or None when nothing moves ------------------------
    def _start_allreduce(self, buf, op):
        if buf.size == 0:
            return None
        spec, mpi_reduce_op = reduction(buf, op)
        return self.comm.Iallreduce(MPI.IN_PLACE, spec, mpi_reduce_op)

    def _start_broadcast(self, buf, root: int):
        if buf.size == 0:
            return None
        return self.comm.Ibcast(as_bytes(buf), root)

    def _start_reduce(self, buf, root: int, op):
        if buf.size == 0:
            return None
        spec, mpi_reduce_op = reduction(buf, op)
        if self.rank == root:
            return self.comm.Ireduce(MPI.IN_PLACE, spec, mpi_reduce_op, root)
        return self.comm.Ireduce(spec, None, mpi_reduce_op, root)

    def _start_allgather(self, out, inp):
        if inp.size == 0:
            return None
        return self.comm.Iallgather(as_bytes(inp), as_bytes(out))

    def _start_reduce_scatter(self, out, inp, op):
        if out.size == 0:
            return None
        return self.comm.Ireduce_scatter_block(*reduce_scatter_specs(out, inp, op))

    def _start_barrier(self):
        return self.comm.Ibarrier()

    def _start_gather(self, out, inp, root: int):
        if inp.size == 0:
            return None
        return self.comm.Igather(as_bytes(inp), as_bytes(out) if self.rank == root else None, root)

    def _start_scatter(self, out, inp, root: int):
        if out.size == 0:
            return None
        return self.comm.Iscatter(as_bytes(inp) if self.rank == root else None, as_bytes(out), root)

    def _start_alltoall(self, out, inp):
        if inp.size == 0:
            return None
        # mpi4py divides a [buffer, BYTE] spec into one block per rank.
        return self.comm.Ialltoall(as_bytes(inp), as_bytes(out))

    def _start_alltoallv(self, out, inp, out_counts, in_counts):
        itemsize = inp.itemsize
        send_counts = [count * itemsize for count in in_counts]
        recv_counts = [count * itemsize for count in out_counts]
        return self.comm.Ialltoallv(
            [inp.reshape(-1).view(np.uint8), (send_counts, _displacements(send_counts)), MPI.BYTE],
            [out.reshape(-1).view(np.uint8), (recv_counts, _displacements(recv_counts)), MPI.BYTE])

    # -- completing ----------------------------------------------------------------------------
    def wait_native(self, request) -> None:
        if request is None:
            return
        if not wait_all([request], self.context.deadline, self.peer_exited):
            self.fail_native(request)

    def fail_native(self, request) -> None:
        """The request did not complete by the deadline (or a peer exited): raise the named error.

        A collective cannot be cancelled in MPI; the group is poisoned by the error, so the
        request is left to the library (the job normally ends with the error).
        """
        raise_timeout(self.rank, self.context, f"the MPI library's {self.context.collective} to complete",
                      self.progress_board)

    def peer_exited(self) -> bool:
        """Can the current collective never complete because an on-node peer's process exited?"""
        board = self.progress_board
        return board is not None and bool(board.exited_before(self.context.seq))

    # -- the transport contract's blocking forms -----------------------------------------------
    def native_allreduce(self, buf, op) -> None:
        self.wait_native(self._start_allreduce(buf, op))

    def native_broadcast(self, buf, root: int) -> None:
        self.wait_native(self._start_broadcast(buf, root))

    def native_reduce(self, buf, root: int, op) -> None:
        self.wait_native(self._start_reduce(buf, root, op))

    def native_allgather(self, out, inp) -> None:
        self.wait_native(self._start_allgather(out, inp))

    def native_reduce_scatter(self, out, inp, op) -> None:
        self.wait_native(self._start_reduce_scatter(out, inp, op))

    def native_barrier(self) -> None:
        self.wait_native(self._start_barrier())

    def native_gather(self, out, inp, root: int) -> None:
        self.wait_native(self._start_gather(out, inp, root))

    def native_scatter(self, out, inp, root: int) -> None:
        self.wait_native(self._start_scatter(out, inp, root))

    def native_alltoall(self, out, inp) -> None:
        self.wait_native(self._start_alltoall(out, inp))

    def native_alltoallv(self, out, inp, out_counts, in_counts) -> None:
        self.wait_native(self._start_alltoallv(out, inp, out_counts, in_counts))


def raise_timeout(rank: int, ctx, waiting_for: str, board=None) -> None:
    """Raise ``CommTimeoutError``, or ``PeerExitedError`` when the wait ended because a peer exited."""
    peers = f" [{board.laggards(ctx.seq, ctx.collective)}]" if board is not None else ""
    gone = board.exited_before(ctx.seq) if board is not None else []
    if gone:
        waited = ctx.timeout - max(0.0, ctx.deadline - time.monotonic())
        raise PeerExitedError(
            f"rank {rank}: {ctx.describe()} cannot complete: rank{'s' if len(gone) > 1 else ''} "
            f"{', '.join(map(str, gone))} exited before joining it (seen after {waited:.2g} s "
            f"waiting for {waiting_for}){peers}"
        )
    raise CommTimeoutError(
        f"rank {rank}: {ctx.describe()} timed out after {ctx.timeout:g} s waiting for "
        f"{waiting_for}{peers}"
    )


def _displacements(counts):
    offsets, total = [], 0
    for count in counts:
        offsets.append(total)
        total += count
    return offsets
