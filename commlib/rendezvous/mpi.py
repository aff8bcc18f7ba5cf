"""The rendezvous of an MPI job: the ranks of one communicator (see :mod:`.interface`)."""

from __future__ import annotations

from typing import Any, List, Optional

from mpi4py import MPI

from commlib.rendezvous.interface import Rendezvous

__all__ = ["MPIRendezvous"]


class MPIRendezvous(Rendezvous):
    """:class:`Rendezvous` over ``comm``, which it uses as it is (the caller owns and frees it)."""

    kind = "mpi"

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._owned: Optional[MPI.Comm] = None  # communicators this object made, freed by close()

    def allgather(self, obj: Any) -> List[Any]:
        return self.comm.allgather(obj)

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        return self.comm.bcast(obj, root=root)

    def all_agree(self, flag: bool) -> bool:
        return bool(self.comm.allreduce(bool(flag), op=MPI.LAND))

    def host_local(self) -> "MPIRendezvous":
        """MPI's shared-memory node of this rank; :meth:`close` it (it frees its communicator)."""
        local = MPIRendezvous(self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank))
        local._owned = local.comm
        return local

    def host_name(self) -> str:
        return MPI.Get_processor_name()

    def split(self, member: bool, key: int) -> Optional["MPIRendezvous"]:
        comm = self.comm.Split(0 if member else MPI.UNDEFINED, key)
        if comm == MPI.COMM_NULL:
            return None
        sub = MPIRendezvous(comm)
        sub._owned = comm
        return sub

    def close(self) -> None:
        owned, self._owned = self._owned, None
        if owned is not None and owned != MPI.COMM_NULL and not MPI.Is_finalized():
            owned.Free()
