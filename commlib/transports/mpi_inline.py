"""The MPI library's collectives in the form the group's small-message fast path calls them.

:meth:`MPITransport.inline_native` hands the group, once per collective, a function
``run(seq, *args)`` that does what ``native_<collective>(*args)`` does on the general path, and
nothing else: mark the progress board, start the nonblocking MPI call, poll it. A small
collective between ranks of one host takes one or two microseconds, and every Python call on
this path costs a tenth of that (measured: a generic starter table and ``*args`` forwarding
added 0.4 us to a 1.5 us ``MPI_Ibcast``), so each function is written out for its collective.
Only a collective still running after ``INLINE_POLLS`` polls pays for the general machinery:
its context is set (the deadline counts from there, microseconds late) and it waits as the
general path does, yielding the core, giving up on a peer that exited, timing out with the
same errors.

The polls do not yield: at two ranks on two cores a ``sched_yield`` in the first microseconds
cost 0.2 us. Where the job's ranks outnumber the machine's cores (:mod:`commlib.machine`) there
is one poll, and the ordinary wait, which then yields after every poll, takes over at once.
"""

from __future__ import annotations

from mpi4py import MPI

from ..machine import oversubscribed
from ..progress_board import CODE_BITS, COLLECTIVE_CODES
from .mpi_natives import as_bytes, reduce_scatter_specs, reduction
from .mpi_types import MPI_PREDEFINED as PLAIN  # dtypes whose arrays export a plain buffer

__all__ = ["make_inline_native", "INLINE_POLLS"]

INLINE_POLLS = 32
BYTE = MPI.BYTE
IN_PLACE = MPI.IN_PLACE


def make_inline_native(transport, collective: str, timeout: float):
    """``run(seq, *args)`` for ``collective`` over ``transport`` (an MPITransport), or None."""
    make = _MAKERS.get(collective)
    if make is None:
        return None
    board = transport.progress_board
    slot = board.mine if board is not None else None
    started = COLLECTIVE_CODES[collective]
    context = transport.context

    def finish(request, seq: int, nbytes: int) -> None:
        context.begin(collective, seq, "native", nbytes, timeout)
        transport._wait_native(request)

    polls = range(1 if oversubscribed() else INLINE_POLLS)
    return make(transport, transport.comm, slot, started, finish, polls)


def _allreduce(transport, comm, slot, started, finish, polls):
    def allreduce(seq, buf, op):
        if slot is not None:
            slot[0] = (seq << CODE_BITS) | started
        spec, mpi_op = reduction(buf, op)
        request = comm.Iallreduce(IN_PLACE, spec, mpi_op)
        test = request.Test
        for _ in polls:
            if test():
                return
        finish(request, seq, buf.nbytes)

    return allreduce


def _broadcast(transport, comm, slot, started, finish, polls):
    def broadcast(seq, buf, root):
        if slot is not None:
            slot[0] = (seq << CODE_BITS) | started
        request = comm.Ibcast([buf, BYTE] if buf.dtype in PLAIN else as_bytes(buf), root)
        test = request.Test
        for _ in polls:
            if test():
                return
        finish(request, seq, buf.nbytes)

    return broadcast


def _reduce(transport, comm, slot, started, finish, polls):
    rank = transport.rank

    def reduce(seq, buf, root, op):
        if slot is not None:
            slot[0] = (seq << CODE_BITS) | started
        spec, mpi_op = reduction(buf, op)
        if root == rank:
            request = comm.Ireduce(IN_PLACE, spec, mpi_op, root)
        else:
            request = comm.Ireduce(spec, None, mpi_op, root)
        test = request.Test
        for _ in polls:
            if test():
                return
        finish(request, seq, buf.nbytes)

    return reduce


def _allgather(transport, comm, slot, started, finish, polls):
    def allgather(seq, out, inp):
        if slot is not None:
            slot[0] = (seq << CODE_BITS) | started
        request = comm.Iallgather([inp, BYTE] if inp.dtype in PLAIN else as_bytes(inp),
                                 [out, BYTE] if out.dtype in PLAIN else as_bytes(out))
        test = request.Test
        for _ in polls:
            if test():
                return
        finish(request, seq, out.nbytes)

    return allgather


def _reduce_scatter(transport, comm, slot, started, finish, polls):
    def reduce_scatter(seq, out, inp, op):
        if slot is not None:
            slot[0] = (seq << CODE_BITS) | started
        request = comm.Ireduce_scatter_block(*reduce_scatter_specs(out, inp, op))
        test = request.Test
        for _ in polls:
            if test():
                return
        finish(request, seq, inp.nbytes)

    return reduce_scatter


def _alltoall(transport, comm, slot, started, finish, polls):
    def alltoall(seq, out, inp):
        if slot is not None:
            slot[0] = (seq << CODE_BITS) | started
        # mpi4py divides a [buffer, BYTE] spec into one block per rank.
        request = comm.Ialltoall([inp, BYTE] if inp.dtype in PLAIN else as_bytes(inp),
                                 [out, BYTE] if out.dtype in PLAIN else as_bytes(out))
        test = request.Test
        for _ in polls:
            if test():
                return
        finish(request, seq, inp.nbytes)

    return alltoall


def _gather(transport, comm, slot, started, finish, polls):
    rank, size = transport.rank, transport.size

    def gather(seq, out, inp, root):
        if slot is not None:
            slot[0] = (seq << CODE_BITS) | started
        request = comm.Igather([inp, BYTE] if inp.dtype in PLAIN else as_bytes(inp),
                               (as_bytes(out) if rank == root else None), root)
        test = request.Test
        for _ in polls:
            if test():
                return
        finish(request, seq, inp.nbytes * size)

    return gather


def _scatter(transport, comm, slot, started, finish, polls):
    rank, size = transport.rank, transport.size

    def scatter(seq, out, inp, root):
        if slot is not None:
            slot[0] = (seq << CODE_BITS) | started
        request = comm.Iscatter(([inp, BYTE] if inp.dtype in PLAIN else as_bytes(inp)) if rank == root else None,
                                [out, BYTE] if out.dtype in PLAIN else as_bytes(out), root)
        test = request.Test
        for _ in polls:
            if test():
                return
        finish(request, seq, out.nbytes * size)

    return scatter


def _barrier(transport, comm, slot, started, finish, polls):
    def barrier(seq):
        if slot is not None:
            slot[0] = (seq << CODE_BITS) | started
        request = comm.Ibarrier()
        test = request.Test
        for _ in polls:
            if test():
                return
        finish(request, seq, 0)

    return barrier


_MAKERS = {
    "allreduce": _allreduce, "broadcast": _broadcast, "reduce": _reduce, "allgather": _allgather,
    "reduce_scatter": _reduce_scatter, "alltoall": _alltoall, "gather": _gather, "scatter": _scatter,
    "barrier": _barrier,
}
