"""PYTHONPATH=. mpiexec -n P python tests/multihost/multihost_topology_ranks.py HOSTS

HOSTS, e.g. ``0,1/2``: ranks 0 and 1 on a host, 2 on another. The group's topology
(``pg.topology``) is what the launcher made: the hosts, in order of their first rank, hold the
ranks ``HOSTS`` lists (``/`` between hosts), each named by its own ``gethostname``; local ranks
follow rank order; a subgroup computes its own. Then ``hierarchical`` allreduces of every phase
shape (tiny, one piece, pipelined pieces) against a closed form, with bit-identical random
floats on every rank.
"""

import hashlib
import socket
import sys

import numpy as np

import commlib
from tests.support.verdict import Checker


def main():
    expected = tuple(tuple(int(r) for r in host.split(",")) for host in sys.argv[1].split("/"))
    pg = commlib.init(timeout=120, segment_bytes=64 << 10)
    rank, size = pg.rank, pg.size
    check = Checker()
    topology = pg.topology
    check.check(topology.host_ranks == expected, f"host ranks {topology.host_ranks}, expected {expected}")
    check.check(topology.host_name == socket.gethostname(),
                f"host name {topology.host_name!r}, gethostname {socket.gethostname()!r}")
    check.check(len(set(topology.host_names)) == len(expected), f"host names {topology.host_names}")
    mine = next(host for host in expected if rank in host)
    check.check((topology.local_rank, topology.local_size) == (mine.index(rank), len(mine)),
                f"local rank {topology.local_rank}/{topology.local_size}")
    check.check(topology.spans_hosts == (len(expected) > 1), f"spans_hosts {topology.spans_hosts}")
    check.check(pg.transport.topology == topology, "the transport hands algorithms the group's topology")
    # Every rank of the tests runs on this one machine, whatever the hosts: waits yield at once
    # when the ranks outnumber its cores (commlib/platform/machine.py).
    from commlib.platform.machine import cores_available, oversubscribed, ranks_on_machine

    check.check(ranks_on_machine() == size, f"ranks on this machine {ranks_on_machine()}, expected {size}")
    check.check(oversubscribed() == (size > cores_available()),
                f"oversubscribed {oversubscribed()} with {size} ranks on {cores_available()} cores")
    # Hierarchical's intra-host phases read the host peers' memory when the group spans hosts and
    # shared memory is on (COMMLIB_SHM); on even hosts they run there, on uneven ones the rings.
    shared = pg.transport.host_shared_memory
    want_shared = topology.spans_hosts and pg.config.shm
    check.check((shared is not None) == want_shared, f"host_shared_memory {shared!r}, expected one: {want_shared}")
    if shared is not None:
        check.check(list(shared.ranks) == list(topology.host_ranks[topology.host_index]),
                    f"shared memory ranks {shared.ranks}, host ranks {topology.host_ranks[topology.host_index]}")
    # A subgroup in reverse rank order: its own ranks, the same hosts.
    members = list(range(size))[::-1]
    sub = pg.new_group(members)
    want = sorted((tuple(sorted(members.index(r) for r in host)), name)
                  for host, name in zip(expected, topology.host_names))
    check.check(sorted(zip(sub.topology.host_ranks, sub.topology.host_names)) == want,
                f"subgroup topology {sub.topology.describe()}, expected {want}")
    # "auto" across hosts: the fitted model's choice when COMMLIB_COST_MODEL names one, else the
    # measured table (commlib/selection/across_hosts.py); one host: the single-host table, as before.
    sizes = (8, 4096, 16384, 1 << 20, 64 << 20)
    chosen = [pg.resolve_algorithm("auto", n) for n in sizes]
    if pg.config.cost_model:
        from commlib.costmodel import CostModel

        model = CostModel.load(pg.config.cost_model)
        want = [model.choose(n, topology.host_count, max(topology.ranks_per_host), commlib.algorithms())[0]
                for n in sizes]
    elif topology.spans_hosts and max(topology.ranks_per_host) > 1:
        want = ["native", "tree", "tree", "native", "hierarchical"]
    elif topology.spans_hosts:
        want = ["native", "recursive_doubling", "native", "native", "native"]
    else:
        from commlib.selection.auto import choose_allreduce

        want = [choose_allreduce(n, size, commlib.algorithms()) for n in sizes]
    check.check(chosen == want, f"auto chose {chosen} at {sizes}, expected {want}")
    digests = []
    for count in (0, 1, size - 1, 7 * size + 3, 300_001, (3 << 20) // 4 + 5):  # the last is pipelined
        exact = (np.arange(count) % 5 + rank).astype(np.float32)
        pg.allreduce(exact, algorithm="hierarchical")
        check.equal(exact, (np.arange(count) % 5 * size + size * (size - 1) // 2).astype(np.float32),
                    f"hierarchical n={count}")
        noisy = np.random.default_rng(rank + 10 * count).standard_normal(count).astype(np.float32)
        sub.allreduce(noisy, algorithm="hierarchical")
        digests.append(hashlib.sha1(noisy.tobytes()).hexdigest())
    everyone = check.comm.allgather(digests)
    check.check(all(d == everyone[0] for d in everyone), "random floats: ranks hold different bytes")
    check.finish()


if __name__ == "__main__":
    main()
