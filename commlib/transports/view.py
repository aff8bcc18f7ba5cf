"""A transport over a subset of another transport's ranks: how a schedule runs on part of a group.

``RankView(parent, members)`` is a :class:`commlib.transports.interface.Transport` whose rank ``i`` is the
parent's rank ``members[i]``. Sends and receives are translated to parent ranks and go through
the parent's ``post``, so they carry the parent's tag (the collective's sequence number), its
deadline and its error messages, which name the real ranks. Local work (``reduce``, ``copy``)
is the parent's, so a GPU transport's stream ordering holds.

Why views and not sub-communicators (``MPI_Comm_split`` per host and per shard position, made
once with the group): a view is written once against the transport interface, so the same
hierarchical schedule runs over MPI, NCCL, host-staged GPU buffers and the in-process test
transport; it creates no MPI object (every one must be freed before ``MPI_Finalize``, and
creating them is collective and needs its own deadline); and it keeps one sequence number, one
deadline and one progress board for the whole collective, so a timeout inside a phase is named
like any other. What a view cannot do is call the library's own collectives on the subset; the
phases run our schedules instead.

Two views of one parent may be used at once from two threads (a pipelined hierarchical
allreduce does): each view takes its scratch buffers from its own range of the parent's slots.
Messages of two views never mix as long as no pair of ranks talks in both at the same time
(MPI matches messages of one pair and tag in posting order).
"""

from __future__ import annotations

from typing import Sequence

from commlib.transports.interface import Pending, Transfer, Transport

__all__ = ["RankView"]


class RankView(Transport):
    def __init__(self, parent: Transport, members: Sequence[int], *, scratch_base: int = 0,
                 label: str = ""):
        self.parent = parent
        self.label = label  # prefixed to the step labels of schedules run on the view
        self.members = tuple(members)
        if parent.rank not in self.members:
            raise ValueError(f"rank {parent.rank} is not a member of the view {self.members}")
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"view members repeat: {self.members}")
        self.rank = self.members.index(parent.rank)
        self.size = len(self.members)
        self.xp = parent.xp
        self.concurrent_posts = parent.concurrent_posts
        self.context = parent.context  # one collective: one sequence number, one deadline
        self._scratch_base = scratch_base
        self._topology = parent.topology.subset(self.members)

    def post(self, sends: Sequence[Transfer] = (), recvs: Sequence[Transfer] = ()) -> Pending:
        members = self.members
        return self.parent.post([(buf, members[peer]) for buf, peer in sends],
                                [(buf, members[peer]) for buf, peer in recvs])

    def reduce(self, dst, src, op, src_first: bool = False) -> None:
        self.parent.reduce(dst, src, op, src_first)

    def copy(self, dst, src) -> None:
        self.parent.copy(dst, src)

    def scratch(self, count: int, dtype, slot: int = 0):
        return self.parent.scratch(count, dtype, self._scratch_base + slot)

    def release_scratch(self) -> None:
        """The parent owns the memory."""

    def step(self, label: str) -> None:
        self.parent.step(f"{self.label}: {label}" if self.label else label)

    def close(self) -> None:
        """Nothing to free: the parent owns everything."""
