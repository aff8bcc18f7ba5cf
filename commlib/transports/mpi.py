"""The MPI transport: point-to-point transfers between ranks of one communicator.

Every transfer moves raw bytes (``MPI.BYTE``), so any dtype numpy knows travels, bfloat16
included; element types matter only to the local reduce. Messages of collective number ``seq``
carry tag ``seq mod 32768``: a rank that skipped or repeated a collective cannot have its
messages matched against the wrong one, and the peers time out instead of computing garbage.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
from mpi4py import MPI

from ..errors import CommTimeoutError, PeerExitedError
from ..transport import CollectiveContext, Pending, Transfer, Transport, format_bytes
from .mpi_types import mpi_datatype, mpi_op
from .polling import wait_all

if TYPE_CHECKING:
    from ..progress_board import ProgressBoard

__all__ = ["MPITransport", "as_bytes"]

TAG_MODULUS = 32768


def as_bytes(buf):
    """An ``MPI.BYTE`` buffer spec over a contiguous array, without copying."""
    return [buf.view(np.uint8), MPI.BYTE]


def typed(buf):
    """A typed buffer spec (for reductions) over a contiguous array, without copying."""
    return [buf.view(np.uint8), buf.size, mpi_datatype(buf.dtype)]


class _MPIPending(Pending):
    __slots__ = ("transport", "requests", "sends", "recvs")

    def __init__(self, transport: "MPITransport", requests, sends, recvs):
        self.transport = transport
        self.requests = requests
        self.sends = sends
        self.recvs = recvs

    def wait(self) -> None:
        transport = self.transport
        if wait_all(self.requests, transport.context.deadline, transport.peer_exited):
            return
        transport.fail_timeout(self.requests, self.sends, self.recvs)


class MPINativeCollectives:
    """The MPI library's own collectives, nonblocking and waited with the group's deadline."""

    # Set by the transport that mixes this in.
    comm: MPI.Comm
    rank: int
    context: CollectiveContext
    progress_board: Optional[ProgressBoard]

    def _wait_native(self, request, nbytes: int) -> None:
        if not wait_all([request], self.context.deadline, self.peer_exited):
            raise_timeout(self.rank, self.context,
                          f"the MPI library's {self.context.collective} to complete",
                          self.progress_board)

    def peer_exited(self) -> bool:
        """Can the current collective never complete because an on-node peer's process exited?"""
        board = self.progress_board
        return board is not None and bool(board.exited_before(self.context.seq))

    def native_allreduce(self, buf, op) -> None:
        if buf.size == 0:
            return
        spec = typed(buf)
        request = self.comm.Iallreduce(MPI.IN_PLACE, spec, mpi_op(buf.dtype, op))
        self._wait_native(request, buf.nbytes)

    def native_broadcast(self, buf, root: int) -> None:
        if buf.size == 0:
            return
        request = self.comm.Ibcast(as_bytes(buf), root=root)
        self._wait_native(request, buf.nbytes)

    def native_reduce(self, buf, root: int, op) -> None:
        if buf.size == 0:
            return
        spec = typed(buf)
        mop = mpi_op(buf.dtype, op)
        if self.rank == root:
            request = self.comm.Ireduce(MPI.IN_PLACE, spec, mop, root=root)
        else:
            request = self.comm.Ireduce(spec, None, mop, root=root)
        self._wait_native(request, buf.nbytes)

    def native_allgather(self, out, inp) -> None:
        if inp.size == 0:
            return
        request = self.comm.Iallgather(as_bytes(inp), as_bytes(out))
        self._wait_native(request, out.nbytes)

    def native_reduce_scatter(self, out, inp, op) -> None:
        if out.size == 0:
            return
        request = self.comm.Ireduce_scatter_block(
            # mpi4py's send spec for reduce_scatter_block counts one block, not the whole input.
            [inp.view(np.uint8), out.size, mpi_datatype(inp.dtype)], typed(out), mpi_op(inp.dtype, op)
        )
        self._wait_native(request, inp.nbytes)

    def native_barrier(self) -> None:
        self._wait_native(self.comm.Ibarrier(), 0)

    def native_gather(self, out, inp, root: int) -> None:
        if inp.size == 0:
            return
        request = self.comm.Igather(as_bytes(inp), as_bytes(out) if self.rank == root else None, root=root)
        self._wait_native(request, inp.nbytes)

    def native_scatter(self, out, inp, root: int) -> None:
        if out.size == 0:
            return
        request = self.comm.Iscatter(as_bytes(inp) if self.rank == root else None, as_bytes(out), root=root)
        self._wait_native(request, out.nbytes)

    def native_alltoall(self, out, inp) -> None:
        if inp.size == 0:
            return
        # mpi4py divides a [buffer, BYTE] spec into one block per rank.
        self._wait_native(self.comm.Ialltoall(as_bytes(inp), as_bytes(out)), inp.nbytes)

    def native_alltoallv(self, out, inp, out_counts, in_counts) -> None:
        itemsize = inp.itemsize
        send_counts = [count * itemsize for count in in_counts]
        recv_counts = [count * itemsize for count in out_counts]
        request = self.comm.Ialltoallv(
            [inp.view(np.uint8), (send_counts, _displacements(send_counts)), MPI.BYTE],
            [out.view(np.uint8), (recv_counts, _displacements(recv_counts)), MPI.BYTE])
        self._wait_native(request, inp.nbytes)


def _displacements(counts):
    offsets, total = [], 0
    for count in counts:
        offsets.append(total)
        total += count
    return offsets


class MPITransport(Transport, MPINativeCollectives):
    xp = np

    def __init__(self, comm: MPI.Comm):
        super().__init__()
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.progress_board = None  # set by the group: names laggards in timeout messages

    @property
    def tag(self) -> int:
        return self.context.seq % TAG_MODULUS

    def post(self, sends: Sequence[Transfer] = (), recvs: Sequence[Transfer] = ()) -> Pending:
        comm, tag = self.comm, self.tag
        requests = [comm.Irecv(as_bytes(buf), source=peer, tag=tag) for buf, peer in recvs]
        requests += [comm.Isend(as_bytes(buf), dest=peer, tag=tag) for buf, peer in sends]
        return _MPIPending(self, requests, sends, recvs)

    def fail_timeout(self, requests, sends, recvs) -> None:
        """Cancel what is still pending (so no late message lands in a user buffer) and raise."""
        n_recv = len(recvs)
        waiting_for = []
        for index, request in enumerate(requests):
            if request.Test():
                continue
            if index < n_recv:
                buf, peer = recvs[index]
                waiting_for.append(f"recv of {format_bytes(buf.nbytes)} from rank {peer}")
                try:
                    request.Cancel()
                    request.Test()
                except MPI.Exception:
                    pass
            else:
                buf, peer = sends[index - n_recv]
                waiting_for.append(f"send of {format_bytes(buf.nbytes)} to rank {peer}")
        raise_timeout(self.rank, self.context, "; ".join(waiting_for) or "completion",
                      self.progress_board)


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

