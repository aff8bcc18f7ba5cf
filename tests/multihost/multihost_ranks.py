"""PYTHONPATH=. python -m commlib.cluster run -n P -ppn K -- python tests/multihost/multihost_ranks.py K HOSTS ADDRS

HOSTS and ADDRS: the cluster's host names and addresses, comma-separated; then ``tcp`` (default)
or ``shm``.

That a job on a cluster of namespaces really spans hosts: rank r runs on host r // K
under that host's own name (``gethostname`` and MPI's processor name), and (``tcp``, the
default) its messages to the same-position rank of the next host travel over a TCP connection of
its own process to that host's address. ``shm`` expects the opposite (no such connection:
MPICH's default path between namespaces of one machine), so the TCP check is seen to fail when
it should.
"""

import os
import socket
import sys
from pathlib import Path


import numpy as np
from mpi4py import MPI

import commlib
from tests.support.verdict import Checker


def socket_inodes(pid):
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def tcp_peers_of_this_process():
    """Remote IPv4 addresses of this process's own established TCP connections.

    Sockets inherited from hydra's proxy (its connection to mpiexec, on the first host) are
    also held by the parent process and do not count.
    """
    inodes = socket_inodes("self") - socket_inodes(os.getppid())
    peers = set()
    for line in Path("/proc/self/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, inode = fields[2], fields[3], fields[9]
        if state == "01" and inode in inodes:  # 01: ESTABLISHED
            peers.add(socket.inet_ntoa(bytes.fromhex(remote.split(":")[0])[::-1]))
    return peers


def check_shared_memory_stays_on_its_host(pg, check, ppn, hosts):
    """A group over several hosts keeps symmetric buffers (host memory) but refuses the shm_*
    algorithms, and "auto" never picks them; a group of one host's ranks runs them."""
    rank, size = pg.rank, pg.size
    check.check(pg.host_memory is not None and not pg.host_memory.single_host
                and not pg.prefers_symmetric_buffers, "a multi-host group is not a shared-memory group")
    symmetric = pg.alloc(1000, np.float64)
    symmetric[...] = rank + 1
    pg.allreduce(symmetric)
    check.equal(symmetric, np.full(1000, size * (size + 1) / 2), "allreduce of a symmetric buffer across hosts")
    for name in ("shm_oneshot", "shm_twoshot"):
        check.raises(commlib.InvalidUsageError, lambda: pg.allreduce(np.ones(4), algorithm=name),
                     f"{name} on a multi-host group", match="spans several hosts")
    picked = {pg.resolve_algorithm("auto", nbytes, symmetric=symmetric_buffer)
              for nbytes in (8, 1 << 16, 1 << 22, 1 << 26) for symmetric_buffer in (False, True)}
    check.check(not any(name.startswith("shm_") for name in picked), f"auto picked {picked} across hosts")
    mine = None
    for host in range(hosts):
        group = pg.new_group(list(range(host * ppn, (host + 1) * ppn)))
        mine = group if group is not None else mine
    check.check(mine.prefers_symmetric_buffers or ppn == 1, "a one-host group uses shared memory")
    data = mine.alloc(5000, np.float32)
    data[...] = rank + 1
    mine.allreduce(data, algorithm="shm_twoshot")
    host_ranks = range(rank // ppn * ppn, (rank // ppn + 1) * ppn)
    check.equal(data, np.full(5000, float(sum(r + 1 for r in host_ranks)), np.float32),
                "shm_twoshot within one host of a cluster")


def main():
    ppn = int(sys.argv[1])
    hostnames, addresses = sys.argv[2].split(","), sys.argv[3].split(",")
    expect_tcp = (sys.argv[4] if len(sys.argv) > 4 else "tcp") == "tcp"
    pg = commlib.init(timeout=60)
    rank, size = pg.rank, pg.size
    check = Checker()
    my_host = rank // ppn
    check.check(socket.gethostname() == hostnames[my_host],
                f"gethostname() {socket.gethostname()!r}, expected {hostnames[my_host]!r}")
    check.check(MPI.Get_processor_name() == hostnames[my_host],
                f"MPI processor name {MPI.Get_processor_name()!r}, expected {hostnames[my_host]!r}")
    names = MPI.COMM_WORLD.allgather(socket.gethostname())
    check.check(len(set(names)) == len(hostnames), f"host names of the ranks {names}: expected "
                f"{len(hostnames)} different ones")
    # A point-to-point exchange with the same-position rank of the next and previous host.
    forward, backward = (rank + ppn) % size, (rank - ppn) % size
    received = np.zeros(1024, np.int64)
    MPI.COMM_WORLD.Sendrecv(np.full(1024, rank, np.int64), dest=forward, recvbuf=received, source=backward)
    check.equal(received, np.full(1024, backward, np.int64), f"message from rank {backward}")
    data = np.full(1000, rank + 1, np.float64)
    pg.allreduce(data)
    check.equal(data, np.full(1000, size * (size + 1) / 2), "allreduce across hosts")
    check_shared_memory_stays_on_its_host(pg, check, ppn, len(hostnames))
    other_hosts = {addresses[(my_host + 1) % len(addresses)], addresses[(my_host - 1) % len(addresses)]}
    over_tcp = tcp_peers_of_this_process() & other_hosts
    if expect_tcp:
        check.check(over_tcp, f"no TCP connection of this process (on {hostnames[my_host]}) to "
                    f"another host's address {sorted(other_hosts)} after messages to ranks "
                    f"{forward} and from {backward}")
    else:
        check.check(not over_tcp, f"TCP connections to {sorted(over_tcp)}, expected none (shm)")
    if rank == 0:
        print(f"ranks per host: {[names.count(h) for h in hostnames]}; rank 0 talks TCP to "
              f"{sorted(tcp_peers_of_this_process())}", flush=True)
    check.finish()


if __name__ == "__main__":
    main()
