"""``algorithm="auto"`` for groups that span hosts: pick by message size and how ranks sit on hosts.

Single-host groups keep the table of :mod:`commlib.selection.auto`. Across hosts the network, not
shared memory, sets the price, and what matters is whether a host holds one rank or several
(several: the hierarchical schedule sends each byte across once per host, the flat ones up to
twice). Rows are ``(largest message in bytes, algorithm)``, the first that covers the message
wins:

* several ranks per host: the library's own for small messages (one call's latency), the
  pipelined tree between 4 and 16 KiB, the library's own again where it and ``hierarchical`` are
  within noise, and ``hierarchical`` above 8 MiB, where sending each byte across once pays;
* one rank per host: the library's own but for recursive doubling at 4-8 KiB (one exchange in
  one latency); from 32 KiB every algorithm moves the same bytes over the one link.

Between 4 and 64 KiB the measurements move by 20-50% from run to run (a shaped link's token
bucket holds about 500 KB, so how full it is when a message starts matters as much as the
algorithm). Data: 2 namespace hosts joined by a 1 Gbit/s link (``commlib.cluster up 2 --rate
1gbit``), docs/benchmarks/hosts-allreduce-2x2 and -2x1.

With ``COMMLIB_COST_MODEL=FILE`` (a model from ``python -m commlib.costmodel fit``) the model's
cheapest prediction for the group's shape decides instead of the table. ``COMMLIB_ALGO`` still
overrides both.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["choose_across_hosts", "native_threshold_across_hosts", "host_class"]

MiB = 1 << 20
INF = float("inf")

KiB = 1 << 10
_SEVERAL_PER_HOST = ((2 * KiB, "native"), (16 * KiB, "tree"), (8 * MiB, "native"), (INF, "hierarchical"))
_ONE_PER_HOST = ((2 * KiB, "native"), (8 * KiB, "recursive_doubling"), (INF, "native"))
_TABLES = {"several": _SEVERAL_PER_HOST, "one": _ONE_PER_HOST}


def host_class(topology) -> str:
    return "one" if max(topology.ranks_per_host) == 1 else "several"


def choose_across_hosts(nbytes: int, topology, available, model=None) -> str:
    if model is not None:
        return model.choose(nbytes, topology.host_count, max(topology.ranks_per_host), available)[0]
    for bound, name in _TABLES[host_class(topology)]:
        if nbytes <= bound:
            return name if name in available else "native"
    return "native"


def native_threshold_across_hosts(topology, override: Optional[str] = None, model=None,
                                  available=None) -> float:
    """Largest message for which ``"auto"`` means ``"native"`` across these hosts (-1: never)."""
    if override:
        return INF if override == "native" else -1
    if model is not None:
        return model.native_threshold(topology.host_count, max(topology.ranks_per_host), available)
    bound: float = -1
    for upper, name in _TABLES[host_class(topology)]:
        if name != "native":
            break
        bound = upper
    return bound
