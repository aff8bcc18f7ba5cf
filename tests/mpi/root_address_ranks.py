"""PYTHONPATH=. mpiexec -n P python tests/mpi/root_address_ranks.py [MASTER_ADDR MASTER_PORT]

The TCP store of the "commlib" torch backend is found by every rank: each rank writes a key and
reads every other rank's. Without MASTER_ADDR, each rank reached rank 0 at one of rank 0's own
interface addresses (127.0.0.1 on one host); with MASTER_ADDR/MASTER_PORT, at exactly those.
The two arguments set those variables in each rank before the store is made (so that both
cases can run in one job of tests/support/job.py, one after the other).
"""

import os
import sys
from datetime import timedelta

from mpi4py import MPI

from autograd_bridge.backend.rendezvous import rendezvous_store
from commlib.platform.addresses import interface_addresses
from commlib.rendezvous.root_probe import reachable_root_address
from tests.support.verdict import Checker


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    check = Checker()
    if len(sys.argv) == 3:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = sys.argv[1], sys.argv[2]
    store = rendezvous_store(timeout=timedelta(seconds=60))
    store.set(f"rank{rank}", f"hello from {rank}")
    for peer in range(size):
        check.check(store.get(f"rank{peer}").decode() == f"hello from {peer}", f"key of rank {peer}")
    master_addr, master_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if master_port:
        check.check(store.port == int(master_port), f"store port {store.port}, MASTER_PORT {master_port}")
    if not master_addr:
        offered = comm.bcast(interface_addresses() if rank == 0 else None, root=0)
        chosen = reachable_root_address(comm)
        one_host = len(set(comm.allgather(MPI.Get_processor_name()))) == 1
        expected = ["127.0.0.1"] if one_host or rank == 0 else offered
        check.check(chosen in expected, f"reached rank 0 at {chosen}, expected one of {expected}")
    comm.Barrier()  # every rank has read every key: now rank 0's server may stop with its store
    del store  # (a later script of the job makes its own)
    check.finish()


if __name__ == "__main__":
    main()
