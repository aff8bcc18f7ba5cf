"""The benchmarks' control plane where there is no MPI (torchrun, spawn): the calls they make on
an mpi4py communicator, over a commlib group.

The benchmarks start every timed call on a barrier, take the slowest rank's times with an
in-place ``MPI.MAX`` reduction, and gather small per-rank counts (:mod:`commlib.bench.timing`,
:mod:`commlib.bench.harness`). Under mpiexec they make those calls on a communicator of their
own, outside commlib; launched without MPI there is none, so :class:`GroupComm` makes the same
calls over a commlib group (its barrier, its allreduce, its rendezvous). Only the names the
benchmarks use exist: anything else is an ``AttributeError``, never a silent no-op.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np

from commlib.ops import ReduceOp

__all__ = ["GroupComm", "is_group_comm"]


class GroupComm:
    """``Get_rank``, ``Get_size``, ``Barrier``, ``Allreduce(MPI.IN_PLACE, array, op)`` (MAX, MIN,
    SUM), ``allgather(count)`` and ``rendezvous`` over the commlib group ``group``."""

    def __init__(self, group):
        self.group = group
        self.rendezvous = group.rendezvous  # how its ranks met: host-local sub-rendezvous for the checks

    def Get_rank(self) -> int:  # mpi4py's names: the benchmarks call either alike
        return self.group.rank

    def Get_size(self) -> int:
        return self.group.size

    def Barrier(self) -> None:
        self.group.barrier()

    def Allreduce(self, sendbuf: Any, recvbuf: np.ndarray, op: Any) -> None:
        """In place only (``sendbuf`` is ``MPI.IN_PLACE``), as every benchmark calls it."""
        from mpi4py import MPI  # its constants only: MPI itself stays uninitialised

        if sendbuf is not MPI.IN_PLACE:
            raise TypeError("GroupComm.Allreduce: only in place (sendbuf MPI.IN_PLACE)")
        for mpi_op, ours in ((MPI.MAX, ReduceOp.MAX), (MPI.MIN, ReduceOp.MIN), (MPI.SUM, ReduceOp.SUM)):
            if op == mpi_op:
                self.group.allreduce(recvbuf, ours)
                return
        raise TypeError(f"GroupComm.Allreduce: op {op!r}: expected MPI.MAX, MPI.MIN or MPI.SUM")

    def allgather(self, obj: Optional[int]) -> List[Optional[int]]:
        """A count (an int >= 0) or None from every rank, over the group itself: not through the
        store's rendezvous, whose round a rank that returns first (rank 0, which serves the store)
        could end by exiting while its peers still close the round."""
        if obj is not None and (not isinstance(obj, int) or obj < 0):
            raise TypeError(f"GroupComm.allgather: a count (int >= 0) or None, got {obj!r}")
        mine = np.array([-1 if obj is None else obj], np.int64)
        everyone = np.empty(self.group.size, np.int64)
        self.group.allgather(everyone, mine)
        return [None if value < 0 else int(value) for value in everyone]


def is_group_comm(comm: Any) -> bool:
    """Whether ``comm`` is a :class:`GroupComm` (no MPI library under it: no MPI baseline)."""
    return isinstance(comm, GroupComm)
