"""How the ranks of a group find each other, before and beside any transport: the contract.

A group is built in two steps, as in gloo (``rendezvous/`` then ``transport/``): its ranks first
*meet* (who is rank ``r`` of ``n``, which ranks share a host, small agreements such as the name
of a shared-memory file), then a transport moves the collectives' bytes between them. A
:class:`Rendezvous` is the first step. Two implement it:

* :class:`commlib.rendezvous.mpi.MPIRendezvous`: an MPI communicator (under ``mpiexec``); its
  "host" is MPI's shared-memory node (``MPI_Comm_split_type(COMM_TYPE_SHARED)``);
* a store-based one (launchers without MPI: torchrun, spawn), where ranks exchange small records
  through a key-value store and a host is the ranks that report the same host name.

Everything that sets a group up (its topology, its progress board, its shared-memory segments,
the crash witness) is written against this class, never against a communicator, so it runs
unchanged whichever way the job was launched.

Every method is collective over the rendezvous' ranks unless it says otherwise, and is meant for
small objects (host names, file names, counts): a few hundred bytes per rank. Objects must
pickle. A rank that never arrives ends the call in :class:`commlib.errors.CommTimeoutError` once
``timeout`` seconds have passed (where the implementation can bound it; MPI's blocking
collectives cannot be, and are only used after a bounded handshake proved every rank is there).
"""

from __future__ import annotations

import abc
from typing import Any, List, Optional

__all__ = ["Rendezvous"]


class Rendezvous(abc.ABC):
    """The ranks of one group as they meet (see the module docstring)."""

    #: This rank's number among the rendezvous' ranks, and how many there are.
    rank: int
    size: int
    #: What kind of rendezvous this is ("mpi", "store"): named in error messages.
    kind: str = ""

    @abc.abstractmethod
    def allgather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order (this rank's included)."""

    def broadcast(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every rank (the others pass anything, usually None)."""
        return self.allgather(obj if self.rank == root else None)[root]

    def all_agree(self, flag: bool) -> bool:
        """True on every rank when every rank passed a true ``flag``; False everywhere otherwise."""
        return all(self.allgather(bool(flag)))

    @abc.abstractmethod
    def host_local(self) -> "Rendezvous":
        """The ranks of this rendezvous that share this rank's host (its memory: shared-memory
        files mapped by one are visible to the others), ordered by rank here. Collective."""

    @abc.abstractmethod
    def host_name(self) -> str:
        """This rank's host name, as errors and the topology show it. Local."""

    @abc.abstractmethod
    def split(self, member: bool, key: int) -> Optional["Rendezvous"]:
        """The rendezvous of the ranks that pass ``member`` (ordered by ``key``), None on the
        others. Collective over every rank of this one."""

    def close(self) -> None:  # noqa: B027 - optional: most rendezvous hold nothing to release
        """Release what the rendezvous holds (a communicator, a connection). Local; idempotent."""
