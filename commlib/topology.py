"""Which ranks of a group share a host: the group's :class:`Topology`.

Terms: a **host** is a set of ranks that share memory (``MPI_Comm_split_type`` with
``COMM_TYPE_SHARED``); hosts are numbered in order of their first (lowest) rank, and a rank's
**local rank** is its position among its host's ranks in rank order. Hosts may hold different
numbers of ranks, and a host's ranks need not be consecutive (``mpiexec -ppn 1`` round-robin
placement, for example).

A group computes its topology once, when it is created (:func:`discover_topology`: one split
and one small allgather of host names), and hands it to its transports as ``transport.topology``:
algorithms that care (``hierarchical``) ask the transport, never environment variables.
Sub-groups compute their own. The in-process transport builds one from a shape
(:meth:`Topology.from_shape`), so schedules can be tested at any shape on one machine.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union, cast

__all__ = ["Topology", "discover_topology"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """The hosts of a group, as seen from one rank (``rank``); the same on every rank but ``rank``.

    ``host_names[h]`` names host ``h``; ``host_ranks[h]`` lists its ranks in rank order.
    ``witness_endpoints[h]`` (may be empty) is where host ``h``'s crash witness answers "where is
    rank r?" over TCP: ``"ADDR,ADDR...:PORT"`` (see :mod:`commlib.reliability.remote_progress`).
    """

    rank: int
    host_names: Tuple[str, ...]
    host_ranks: Tuple[Tuple[int, ...], ...]
    witness_endpoints: Tuple[str, ...] = ()

    def __post_init__(self) -> None:
        every = sorted(r for ranks in self.host_ranks for r in ranks)
        if every != list(range(len(every))) or not every:
            raise ValueError(f"topology: hosts must partition ranks 0..p-1, got {self.host_ranks}")
        if len(self.host_names) != len(self.host_ranks):
            raise ValueError(f"topology: {len(self.host_names)} host names for {len(self.host_ranks)} hosts")
        if any(tuple(sorted(ranks)) != tuple(ranks) for ranks in self.host_ranks):
            raise ValueError(f"topology: each host's ranks must be in rank order, got {self.host_ranks}")
        firsts = [ranks[0] for ranks in self.host_ranks]
        if firsts != sorted(firsts):
            raise ValueError(f"topology: hosts must be ordered by their first rank, got {self.host_ranks}")
        if not 0 <= self.rank < len(every):
            raise ValueError(f"topology: rank {self.rank} outside 0..{len(every) - 1}")

    # -- construction --------------------------------------------------------------------------
    @classmethod
    def single_host(cls, rank: int, size: int, name: str = "localhost") -> "Topology":
        return cls(rank, (name,), (tuple(range(size)),))

    @classmethod
    def from_shape(cls, rank: int, shape: Sequence[Union[int, Sequence[int]]],
                   names: Optional[Sequence[str]] = None) -> "Topology":
        """A topology from ranks per host (``[3, 2, 1]``: ranks 0-2, 3-4, 5) or from explicit rank
        lists per host (``[[0, 2, 4], [1, 3, 5]]``)."""
        host_ranks: List[Tuple[int, ...]] = []
        if all(isinstance(item, int) for item in shape):
            start = 0
            for count in cast(Sequence[int], shape):
                if count < 1:
                    raise ValueError(f"topology: every host needs at least one rank, got {list(shape)}")
                host_ranks.append(tuple(range(start, start + count)))
                start += count
        else:
            host_ranks = sorted((tuple(sorted(ranks)) for ranks in cast(Sequence[Sequence[int]], shape)),
                                key=lambda ranks: ranks[0])
        names = tuple(names) if names is not None else tuple(f"host{h}" for h in range(len(host_ranks)))
        return cls(rank, names, tuple(host_ranks))

    def for_rank(self, rank: int) -> "Topology":
        return dataclasses.replace(self, rank=rank)

    def subset(self, members: Sequence[int]) -> "Topology":
        """The topology of the group of ``members`` (ranks of this one, in their new rank order)
        as seen from this rank, which must be a member."""
        position = {member: index for index, member in enumerate(members)}
        chosen = []
        for host, ranks in enumerate(self.host_ranks):
            inside = tuple(sorted(position[r] for r in ranks if r in position))
            if inside:
                endpoint = self.witness_endpoints[host] if self.witness_endpoints else ""
                chosen.append((inside, self.host_names[host], endpoint))
        chosen.sort(key=lambda item: item[0][0])
        return Topology(position[self.rank], tuple(name for _, name, _ in chosen),
                        tuple(ranks for ranks, _, _ in chosen),
                        tuple(endpoint for _, _, endpoint in chosen) if self.witness_endpoints else ())

    # -- what algorithms ask -------------------------------------------------------------------
    @property
    def size(self) -> int:
        return sum(len(ranks) for ranks in self.host_ranks)

    @property
    def host_count(self) -> int:
        return len(self.host_ranks)

    @property
    def spans_hosts(self) -> bool:
        return len(self.host_ranks) > 1

    @property
    def ranks_per_host(self) -> Tuple[int, ...]:
        return tuple(len(ranks) for ranks in self.host_ranks)

    @property
    def uniform(self) -> bool:
        """Every host holds the same number of ranks."""
        return len(set(self.ranks_per_host)) == 1

    def host_of(self, rank: int) -> int:
        for host, ranks in enumerate(self.host_ranks):
            if rank in ranks:
                return host
        raise ValueError(f"topology: no rank {rank} in a group of {self.size}")

    def local_rank_of(self, rank: int) -> int:
        return self.host_ranks[self.host_of(rank)].index(rank)

    @property
    def host_index(self) -> int:
        return self.host_of(self.rank)

    @property
    def host_name(self) -> str:
        return self.host_names[self.host_index]

    @property
    def local_rank(self) -> int:
        return self.local_rank_of(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.host_ranks[self.host_index])

    def host_name_of(self, rank: int) -> str:
        return self.host_names[self.host_of(rank)]

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of(a) == self.host_of(b)

    def describe(self) -> str:
        """One line: ``2 hosts: h0 [0,1], h1 [2,3]``."""
        hosts = ", ".join(f"{name} [{','.join(map(str, ranks))}]"
                          for name, ranks in zip(self.host_names, self.host_ranks))
        return f"{self.host_count} host{'s' if self.host_count != 1 else ''}: {hosts}"


def discover_topology(rendezvous, witness_endpoint: str = "") -> Topology:
    """Collective over ``rendezvous`` (a :class:`commlib.rendezvous.interface.Rendezvous`): which
    of its ranks share a host, and the hosts' names.

    The host-local rendezvous (MPI: ``MPI_Comm_split_type(COMM_TYPE_SHARED)``) tells this rank who
    shares its memory; the lowest of those ranks identifies the host (two hosts could report the
    same name, a split never merges them). One allgather of ``(host id, host name, witness
    endpoint)`` tells every rank the whole picture.
    """
    rank, size = rendezvous.rank, rendezvous.size
    if size == 1:
        return Topology(0, (rendezvous.host_name(),), ((0,),), (witness_endpoint,))
    host = rendezvous.host_local()
    try:
        host_id = min(host.allgather(rank))
    finally:
        host.close()
    everyone = rendezvous.allgather((host_id, rendezvous.host_name(), witness_endpoint))
    ids = sorted({entry[0] for entry in everyone})
    host_ranks = tuple(tuple(r for r in range(size) if everyone[r][0] == host) for host in ids)
    names = tuple(everyone[host][1] for host in ids)
    endpoints = tuple(everyone[host][2] for host in ids)
    return Topology(rank, names, host_ranks, endpoints if any(endpoints) else ())
