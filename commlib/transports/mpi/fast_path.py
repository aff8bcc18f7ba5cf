"""The MPI library's collectives in the form the group's small-message fast path calls them.

:meth:`MPITransport.inline_native` hands the group, once per collective, a function
``run(seq, limit, *args) -> bool`` (padded to three arguments with None, see
:meth:`~commlib.execution.executor.CommExecutor.inline_runner`): if the call is plain enough (host numpy buffers,
C-contiguous, writable where written, a dtype and op the library takes directly, a valid root,
consistent sizes, at most ``limit`` bytes as the group keys the collective) it does what
``native_<collective>(*args)`` does on the general path and nothing else: start the nonblocking
MPI call, mark the progress board (after the call: the peers wait for the call, not for the
mark), poll it; True. Otherwise it touches nothing and returns
False, and the general path validates and explains. The executor calls it under its issue lock
(:meth:`commlib.execution.executor.CommExecutor.inline_runner`), numbered ``seq``.

A small collective between ranks of one host takes one or two microseconds, and every Python
call on this path costs a tenth of that, so each function is written out for its collective,
checks included (measured at two ranks, 8-byte broadcast, interleaved in one job: checks in a
group method of their own, then a generic executor call, then this function: 2.04-2.15 us; the
checks here, under the lock: 1.92 us; ``MPI_Bcast`` 1.29 us). Only a collective still running
after ``INLINE_POLLS`` polls pays for the general machinery: its context is set (the deadline
counts from there, microseconds late) and it waits as the general path does, yielding the
core, giving up on a peer that exited, timing out with the same errors.

The polls do not yield: at two ranks on two cores a ``sched_yield`` in the first microseconds
cost 0.2 us. Where the job's ranks outnumber the machine's cores (:mod:`commlib.platform.machine`) there
is one poll, then ``YIELDING_POLLS`` polls each after a ``sched_yield`` (the peers need this
core to make the progress waited for), and only then the general wait, which yields after every
poll too; its deadline then counts from there, a few time slices late at most.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from commlib.ops import DTYPE_IS_FLOAT, ReduceOp
from commlib.platform.machine import oversubscribed
from commlib.reliability.progress_board import CODE_BITS, COLLECTIVE_CODES
from commlib.transports.mpi.natives import TAG_MODULUS, as_bytes
from commlib.transports.mpi.types import MPI_PREDEFINED as PLAIN  # dtypes whose arrays export a plain buffer

__all__ = ["make_inline_native", "make_inline_pair", "INLINE_POLLS", "PAIR_SCHEDULE"]

INLINE_POLLS = 32
# Ranks outnumber cores: polls each after a yield before the general wait takes over. Its
# set-up (context, deadline, the wait's closures) is a microsecond of Python, paid twice over
# when four ranks share two cores; a small collective there needs a few dozen yields.
YIELDING_POLLS = 64
BYTE = MPI.BYTE
IN_PLACE = MPI.IN_PLACE
NDARRAY = np.ndarray
_SUM, _MIN, _MAX = ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX
MPI_SUM, MPI_MIN, MPI_MAX = MPI.SUM, MPI.MIN, MPI.MAX
# The reductions taken here are the library's predefined ops on its predefined datatypes, with
# nothing after them (AVG divides; bfloat16 needs a user op: both take the general path).
# ReduceOp members are matched by identity, since hashing an Enum member runs Python code
# (0.3 us); names through this table.
_MPI_OPS_BY_NAME = {"sum": MPI_SUM, "min": MPI_MIN, "max": MPI_MAX, "SUM": MPI_SUM, "MIN": MPI_MIN, "MAX": MPI_MAX}


def make_inline_native(transport, collective: str, timeout: float):
    """``run(seq, limit, a, b, c) -> bool`` for ``collective`` over ``transport`` (an MPITransport), or None."""
    make = _MAKERS.get(collective)
    if make is None:
        return None

    def finish(request, seq: int, nbytes: int, _transfer=None) -> None:
        transport.context.begin(collective, seq, "native", nbytes, timeout)
        transport.wait_native(request)

    return _made(make, transport, collective, finish, pair=False)


def make_inline_pair(transport, collective: str, timeout: float):
    """``(PAIR_SCHEDULE, run)`` for ``collective`` between two ranks, or None.

    At two ranks our ``binomial`` broadcast and scatter are one message from the root to the
    other rank. ``run`` sends exactly that message, ``MPI_Isend``/``MPI_Irecv`` of the same bytes
    on the same communicator and tag (the collective's number, see ``MPITransport.tag``) as the
    general path's ``binomial``, so a rank on this path and one on the general path (busy
    line, ``async_op``) still match. Measured at two ranks, 8 B, per rank (root / other): that
    message polled to completion took 1.0 / 1.0 us, the library's ``MPI_Iscatter`` 1.4 / 1.5
    and its blocking ``MPI_Scatter`` 0.9 / 1.6 us, so the library's own schedule, not the
    message, is what a small scatter waits for.
    """
    make = _PAIR_MAKERS.get(collective)
    if make is None or transport.size != 2:
        return None

    def finish(request, seq: int, nbytes: int, transfer=None) -> None:
        transport.context.begin(collective, seq, PAIR_SCHEDULE, nbytes, timeout)
        buf, peer, sending = transfer
        transport.wait_transfers([request], ((buf, peer),) if sending else (), () if sending else ((buf, peer),))

    return PAIR_SCHEDULE, _made(make, transport, collective, finish, pair=True)


def _made(make, transport, collective: str, finish, pair: bool):
    board = transport.progress_board
    # Always a slot to mark (a private one without a board): one test less on the path.
    slot = board.mine_slot if board is not None else None
    if slot is None:
        slot = [0]
    started = COLLECTIVE_CODES[collective]
    extra = {"pair": True} if pair else {}
    if not oversubscribed():
        return make(transport, transport.comm, slot, started, finish, range(INLINE_POLLS), **extra)

    yielding_polls, sched_yield = range(YIELDING_POLLS), os.sched_yield

    def yield_then_finish(request, seq: int, nbytes: int, transfer=None) -> None:
        test = request.Test
        for _ in yielding_polls:  # poll first: the run's one poll came before the peers' posts
            if test():
                return
            sched_yield()
        finish(request, seq, nbytes, transfer)

    return make(transport, transport.comm, slot, started, yield_then_finish, range(1), **extra)


# Each run first decides, touching nothing, whether the call is one it takes (False: the general
# path validates and explains), then starts the library's call and polls it. Empty buffers are
# declined: the general path makes no MPI call for them (natives.py), and MPICH gives even a
# zero-count nonblocking collective a tag of the communicator's sequence, so a rank calling it
# while a peer does not would pair every later collective with the wrong one (seen: PowerSGD's
# empty allreduce of uncompressed tensors, eager on one rank and queued on the other, then a
# hang or a wrong result).

def _allreduce(transport, comm, slot, started, finish, polls):
    def allreduce(seq, limit, buf, op, _unused=None):
        if buf.__class__ is not NDARRAY or not 0 < buf.nbytes <= limit:
            return False
        flags = buf.flags
        if not (flags.c_contiguous and flags.writeable):
            return False
        mpi_op = (MPI_SUM if op is _SUM else MPI_MAX if op is _MAX else MPI_MIN if op is _MIN
                  else _MPI_OPS_BY_NAME.get(op) if op.__class__ is str else None)
        datatype = PLAIN.get(buf.dtype)
        if mpi_op is None or datatype is None:
            return False
        request = comm.Iallreduce(IN_PLACE, [buf, buf.size, datatype], mpi_op)
        slot[0] = (seq << CODE_BITS) | started
        test = request.Test
        for _ in polls:
            if test():
                return True
        finish(request, seq, buf.nbytes)
        return True

    return allreduce


def _broadcast(transport, comm, slot, started, finish, polls, pair=False):
    rank, size = transport.rank, transport.size

    def broadcast(seq, limit, buf, root, _unused=None):
        if buf.__class__ is not NDARRAY or not 0 < buf.nbytes <= limit:
            return False
        flags = buf.flags
        if not (flags.c_contiguous and flags.writeable) or root.__class__ is not int or not 0 <= root < size:
            return False
        spec = [buf, BYTE] if buf.dtype in PLAIN else as_bytes(buf) if buf.dtype in DTYPE_IS_FLOAT else None
        if spec is None:
            return False
        if not pair:
            request = comm.Ibcast(spec, root)
        elif not buf.nbytes:  # binomial sends nothing for an empty buffer
            slot[0] = (seq << CODE_BITS) | started
            return True
        elif root == rank:
            request = comm.Isend(spec, 1 - rank, seq % TAG_MODULUS)
        else:
            request = comm.Irecv(spec, root, seq % TAG_MODULUS)
        slot[0] = (seq << CODE_BITS) | started
        test = request.Test
        for _ in polls:
            if test():
                return True
        finish(request, seq, buf.nbytes, (buf, 1 - rank if root == rank else root, root == rank))
        return True

    return broadcast


def _reduce(transport, comm, slot, started, finish, polls):
    rank, size = transport.rank, transport.size

    def reduce(seq, limit, buf, root, op):
        if buf.__class__ is not NDARRAY or not 0 < buf.nbytes <= limit:
            return False
        flags = buf.flags
        if (not (flags.c_contiguous and flags.writeable) or root.__class__ is not int
                or not 0 <= root < size):
            return False
        mpi_op = (MPI_SUM if op is _SUM else MPI_MAX if op is _MAX else MPI_MIN if op is _MIN
                  else _MPI_OPS_BY_NAME.get(op) if op.__class__ is str else None)
        datatype = PLAIN.get(buf.dtype)
        if mpi_op is None or datatype is None:
            return False
        spec = [buf, buf.size, datatype]
        if root == rank:
            request = comm.Ireduce(IN_PLACE, spec, mpi_op, root)
        else:
            request = comm.Ireduce(spec, None, mpi_op, root)
        slot[0] = (seq << CODE_BITS) | started
        test = request.Test
        for _ in polls:
            if test():
                return True
        finish(request, seq, buf.nbytes)
        return True

    return reduce


def _allgather(transport, comm, slot, started, finish, polls):
    size = transport.size

    def allgather(seq, limit, out, inp, _unused=None):
        if out.__class__ is not NDARRAY or not 0 < out.nbytes <= limit:
            return False
        if not _plain_pair(out, inp) or out.size != size * inp.size:
            return False
        request = comm.Iallgather([inp, BYTE] if inp.dtype in PLAIN else as_bytes(inp),
                                  [out, BYTE] if out.dtype in PLAIN else as_bytes(out))
        slot[0] = (seq << CODE_BITS) | started
        test = request.Test
        for _ in polls:
            if test():
                return True
        finish(request, seq, out.nbytes)
        return True

    return allgather


def _reduce_scatter(transport, comm, slot, started, finish, polls):
    size = transport.size

    def reduce_scatter(seq, limit, out, inp, op):
        if inp.__class__ is not NDARRAY or not 0 < inp.nbytes <= limit:
            return False
        mpi_op = (MPI_SUM if op is _SUM else MPI_MAX if op is _MAX else MPI_MIN if op is _MIN
                  else _MPI_OPS_BY_NAME.get(op) if op.__class__ is str else None)
        datatype = PLAIN.get(out.dtype)
        if mpi_op is None or datatype is None or not _plain_pair(out, inp) or inp.size != size * out.size:
            return False
        # mpi4py's send spec for reduce_scatter_block counts one block, not the whole input.
        count = out.size
        request = comm.Ireduce_scatter_block([inp, count, datatype], [out, count, datatype], mpi_op)
        slot[0] = (seq << CODE_BITS) | started
        test = request.Test
        for _ in polls:
            if test():
                return True
        finish(request, seq, inp.nbytes)
        return True

    return reduce_scatter


def _alltoall(transport, comm, slot, started, finish, polls):
    size = transport.size

    def alltoall(seq, limit, out, inp, _unused=None):
        if inp.__class__ is not NDARRAY or not 0 < inp.nbytes <= limit:
            return False
        if not _plain_pair(out, inp) or out.size != inp.size or inp.size % size:
            return False
        # mpi4py divides a [buffer, BYTE] spec into one block per rank.
        request = comm.Ialltoall([inp, BYTE] if inp.dtype in PLAIN else as_bytes(inp),
                                 [out, BYTE] if out.dtype in PLAIN else as_bytes(out))
        slot[0] = (seq << CODE_BITS) | started
        test = request.Test
        for _ in polls:
            if test():
                return True
        finish(request, seq, inp.nbytes)
        return True

    return alltoall


def _gather(transport, comm, slot, started, finish, polls):
    rank, size = transport.rank, transport.size

    def gather(seq, limit, out, inp, root):
        if inp.__class__ is not NDARRAY or not 0 < inp.nbytes * size <= limit:
            return False
        if root.__class__ is not int or not 0 <= root < size:
            return False
        if root == rank:
            if not _plain_pair(out, inp) or out.size != size * inp.size:
                return False
        elif not (inp.flags.c_contiguous and inp.dtype in DTYPE_IS_FLOAT):
            return False
        request = comm.Igather([inp, BYTE] if inp.dtype in PLAIN else as_bytes(inp),
                               (as_bytes(out) if rank == root else None), root)
        slot[0] = (seq << CODE_BITS) | started
        test = request.Test
        for _ in polls:
            if test():
                return True
        finish(request, seq, inp.nbytes * size)
        return True

    return gather


def _scatter(transport, comm, slot, started, finish, polls, pair=False):
    rank, size = transport.rank, transport.size

    def scatter(seq, limit, out, inp, root):
        # The root's checks decide how soon every rank gets its block: written out here, not
        # through _plain_pair (a call is a tenth of the library's 1.3 us scatter).
        if (out.__class__ is not NDARRAY or not 0 < out.nbytes * size <= limit or root.__class__ is not int
                or not 0 <= root < size or out.dtype not in PLAIN):
            return False
        out_flags = out.flags
        if not (out_flags.c_contiguous and out_flags.writeable):
            return False
        if root == rank:
            if inp.__class__ is not NDARRAY or inp.dtype is not out.dtype or inp.size != size * out.size:
                return False
            inp_flags = inp.flags  # one flags object: each costs 40 ns
            if not inp_flags.c_contiguous:
                return False
            if not (out_flags.owndata and inp_flags.owndata and out is not inp) and np.may_share_memory(out, inp):
                return False
        if not pair:
            request = comm.Iscatter([inp, BYTE] if root == rank else None, [out, BYTE], root)
        elif root == rank:  # the other rank's block goes, this rank's is copied (after the send)
            block = out.size
            blocks = inp if inp.ndim == 1 else inp.reshape(-1)  # C-contiguous: a view
            if rank:
                request = comm.Isend([blocks[:block], BYTE], 0, seq % TAG_MODULUS)
                (out if out.ndim == 1 else out.reshape(-1))[...] = blocks[block:]
            else:
                request = comm.Isend([blocks[block:], BYTE], 1, seq % TAG_MODULUS)
                (out if out.ndim == 1 else out.reshape(-1))[...] = blocks[:block]
        else:
            request = comm.Irecv([out, BYTE], root, seq % TAG_MODULUS)
        slot[0] = (seq << CODE_BITS) | started
        test = request.Test
        for _ in polls:
            if test():
                return True
        finish(request, seq, out.nbytes * size, (out, 1 - rank if root == rank else root, root == rank))
        return True

    return scatter


def _barrier(transport, comm, slot, started, finish, polls):
    def barrier(seq, limit, _a=None, _b=None, _c=None):
        if limit < 0:
            return False
        request = comm.Ibarrier()
        slot[0] = (seq << CODE_BITS) | started
        test = request.Test
        for _ in polls:
            if test():
                return True
        finish(request, seq, 0)
        return True

    return barrier


def _plain_pair(out, inp) -> bool:
    """Both plain numpy, one supported dtype, usable in place, and apart in memory: two arrays
    that own their data are separate allocations; otherwise numpy's bounds test, and what it
    cannot rule out goes to the general path's exact check."""
    if out.__class__ is not NDARRAY or inp.__class__ is not NDARRAY or out.dtype is not inp.dtype:
        return False
    out_flags, inp_flags = out.flags, inp.flags
    if not (out_flags.c_contiguous and out_flags.writeable and inp_flags.c_contiguous
            and out.dtype in DTYPE_IS_FLOAT):
        return False
    if out_flags.owndata and inp_flags.owndata:
        return out is not inp
    return not np.may_share_memory(out, inp)


_MAKERS = {
    "allreduce": _allreduce, "broadcast": _broadcast, "reduce": _reduce, "allgather": _allgather,
    "reduce_scatter": _reduce_scatter, "alltoall": _alltoall, "gather": _gather, "scatter": _scatter,
    "barrier": _barrier,
}
# The collectives whose schedule at two ranks is one message, and the schedule (see make_inline_pair).
_PAIR_MAKERS = {"broadcast": _broadcast, "scatter": _scatter}
PAIR_SCHEDULE = "binomial"
