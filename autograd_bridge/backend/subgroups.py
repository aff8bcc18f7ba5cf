"""The commlib groups under the backend's torch groups: the world, a subgroup, a split.

torch's ranks are MPI's (checked by :mod:`.rendezvous`), so a torch group of global ranks
``members`` is the MPI communicator of those ranks. ``new_group`` calls the backend on members
only, which :func:`subgroup` serves with a group-collective ``MPI_Comm_create_group``;
``ProcessGroup.split_group`` calls it on *every* rank of the parent, each naming its own part
(ranks of the parent), which :func:`split` serves with one ``MPI_Comm_split``, after checking
over the parent (a bounded commlib collective) that the parts agree.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

import commlib
from commlib import InvalidUsageError

__all__ = ["timeout_for", "subgroup", "split"]


def timeout_for(requested_seconds: Optional[float]) -> float:
    """A group's timeout: torch's when shorter than commlib's (``COMMLIB_TIMEOUT``), else commlib's.

    torch always passes one (30 min unless given): a longer one is capped, since a commlib group
    that already exists keeps its own anyway."""
    config_timeout = commlib.load_config().timeout
    if requested_seconds and requested_seconds > 0:
        return min(requested_seconds, config_timeout)
    return config_timeout


def _group_like(world: "commlib.ProcessGroup", comm, timeout: float, name: str) -> "commlib.ProcessGroup":
    return commlib.ProcessGroup(comm, timeout=timeout, config=world.config, debug=world.debug, name=name,
                                segment_bytes=world.segment_bytes)


def subgroup(world: "commlib.ProcessGroup", members: Sequence[int], timeout: float) -> "commlib.ProcessGroup":
    """The group of global ranks ``members`` (called on members only)."""
    members = list(members)
    assert world.comm is not None  # the caller checked that the ranks are MPI's
    if members == list(range(world.size)):
        comm = world.comm.Dup()
    else:  # a group-collective create: only members take part
        everyone = world.comm.Get_group()
        chosen = everyone.Incl(members)
        # A group's communicator is an intracommunicator (typed MPI.Comm by ProcessGroup).
        comm = world.comm.Create_group(chosen, tag=17)  # type: ignore[attr-defined]
        chosen.Free()
        everyone.Free()
    return _group_like(world, comm, timeout, f"torch-{'-'.join(map(str, members))}")


def split(parent: "commlib.ProcessGroup", part: Sequence[int], timeout: float) -> Optional["commlib.ProcessGroup"]:
    """Collective over ``parent``: the group of ``part`` (ranks of the parent) if this rank is in it, else None.

    Every rank passes its own part (a rank in no part passes any other rank's); the parts must
    agree (a rank named in ``part`` passes the same ``part``), else ``InvalidUsageError`` on every
    rank, before any communicator is made."""
    from mpi4py import MPI

    if parent.comm is None:
        raise InvalidUsageError(f"commlib backend: split_group of {parent!r}: its ranks met through a store, "
                                f"not MPI; split groups need a job launched with mpiexec (new_group works)")
    part = sorted(int(r) for r in part)
    parts = _everyone_s_part(parent, part)
    rank = parent.rank
    for asker, asked in enumerate(parts):
        for member in asked:
            if not 0 <= member < parent.size or parts[member] != asked:
                theirs = parts[member] if 0 <= member < parent.size else "no rank"
                raise InvalidUsageError(
                    f"commlib backend: split_group: rank {asker} of {parent!r} asks for the group {asked}, "
                    f"but rank {member} asks for {theirs}; expected every member of a part to pass that part")
    member = rank in part
    comm = parent.comm.Split(part[0] if member else MPI.UNDEFINED, part.index(rank) if member else 0)
    if not member:
        return None
    parent_group, world_group = parent.comm.Get_group(), MPI.COMM_WORLD.Get_group()
    world_ranks = MPI.Group.Translate_ranks(parent_group, part, world_group)
    parent_group.Free()
    world_group.Free()
    return _group_like(parent, comm, timeout, f"torch-{'-'.join(map(str, world_ranks))}")


def _everyone_s_part(parent: "commlib.ProcessGroup", part: List[int]) -> List[List[int]]:
    lengths = np.empty(parent.size, np.int64)
    parent.allgather(lengths, np.array([len(part)], np.int64))
    width = max(1, int(lengths.max()))
    mine = np.full(width, -1, np.int64)
    mine[:len(part)] = part
    everyone = np.empty((parent.size, width), np.int64)
    parent.allgather(everyone, mine)
    return [everyone[r, :int(lengths[r])].tolist() for r in range(parent.size)]
