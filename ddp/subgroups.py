"""Subgroups for local SGD and hierarchical averaging: which ranks share a host, and groups of k.

Every function here is collective over ``group`` (each rank calls it, in the same order), and
returns the subgroup this rank belongs to. Which ranks share a host comes from the group's
topology (``group.topology``, MPI's shared-memory split, see :mod:`commlib.topology`) and, for a
group without one, from exchanging a hash of each rank's host name (namespaced "hosts" on one
machine have their own names). :func:`host_of_each_rank` is the one place that asks.
"""

from __future__ import annotations

import hashlib
import socket
from typing import Dict, List, Sequence, Tuple

import numpy as np

__all__ = ["host_of_each_rank", "host_subgroup", "subgroups_of_size", "subgroup_of"]


def _host_key() -> int:
    digest = hashlib.sha256(socket.gethostname().encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def host_of_each_rank(group) -> List[int]:
    """Host number (0, 1, ... in order of first rank) of every rank of ``group``. Collective
    unless the group knows its topology (commlib groups do: ``group.topology``)."""
    topology = getattr(group, "topology", None)
    if topology is not None and hasattr(topology, "host_of"):
        return [topology.host_of(rank) for rank in range(group.size)]
    keys = np.empty(group.size, np.int64)
    group.allgather(keys, np.array([_host_key()], np.int64))
    numbers: Dict[int, int] = {}
    return [numbers.setdefault(int(key), len(numbers)) for key in keys]


def subgroup_of(group, partition: Sequence[Sequence[int]]) -> Tuple[object, List[int]]:
    """Create every part of ``partition`` (lists of ranks of ``group``) as a group, in order, and
    return (the part this rank is in, its ranks in ``group``). The whole group is reused rather
    than duplicated. Collective."""
    mine = None
    for ranks in partition:
        ranks = list(ranks)
        if len(ranks) == group.size:
            return group, ranks
        created = group.new_group(ranks)
        if created is not None:
            mine = created, ranks
    assert mine is not None  # a partition holds every rank (both callers build one)
    return mine


def host_subgroup(group):
    """(The ranks of ``group`` on this rank's host as a group, their ranks in ``group``);
    ``group`` itself on one host."""
    hosts = host_of_each_rank(group)
    partition = [[r for r in range(group.size) if hosts[r] == host] for host in sorted(set(hosts))]
    return subgroup_of(group, partition)


def subgroups_of_size(group, size: int, *, follow_hosts: bool = True):
    """Split ``group`` into consecutive groups of ``size`` ranks (torch's ``new_subgroups``) and
    return this rank's. With ``follow_hosts``, ranks are ordered by host first, so a group of the
    host's size is the host when hosts hold equal counts of ranks, whatever the rank numbering.
    Returns (this rank's group, its ranks in ``group``)."""
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= group.size or group.size % size:
        raise ValueError(f"subgroup size must divide the group size {group.size}, got {size!r}")
    ranks = list(range(group.size))
    if follow_hosts and size not in (1, group.size):
        hosts = host_of_each_rank(group)
        ranks.sort(key=lambda r: (hosts[r], r))
    partition = [ranks[start:start + size] for start in range(0, group.size, size)]
    return subgroup_of(group, partition)
