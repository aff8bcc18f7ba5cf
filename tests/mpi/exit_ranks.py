"""PYTHONPATH=. mpiexec -n P python tests/mpi/exit_ranks.py MODE

P >= 2; the test checks the exit status. Programs that end cleanly must exit 0 on every rank,
also over MPICH's OFI netmod, where an MPI object left allocated at MPI_Finalize made every rank
exit 15. Modes:

* ``commlib``: ``commlib.init()`` and one allreduce.
* ``subgroup``: a subgroup from ``new_group`` (and one of the ranks left out), one allreduce each.
* ``torch``: ``autograd_bridge.init_process_group()``, ``dist.all_reduce``, a torch subgroup.
* ``early``: the last rank exits right after a collective while the others keep running; it
  must really end (its process gone or a zombie) while they wait, they must see it marked
  exited (on their progress board when they share its host, from its host's crash witness
  otherwise), and they then finish on their own.
"""

import os
import sys
import time
from pathlib import Path


import numpy as np
from mpi4py import MPI

import commlib
from tests.support.verdict import Checker

EXIT_WAIT = 60.0  # seconds the survivors wait for the early rank's process to end


def process_ended(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"  # a zombie has exited; its parent has not reaped it


def early_exit(pg, check_survivors):
    last = pg.size - 1
    pids = np.zeros(pg.size, np.int64)
    pg.allgather(pids, np.array([os.getpid()], np.int64))
    hosts = MPI.COMM_WORLD.allgather(MPI.Get_processor_name())
    survivors = pg.new_group(list(range(last)))
    pg.barrier()
    if pg.rank == last:
        sys.exit(0)  # through the interpreter: atexit, commlib's teardown, MPI_Finalize
    started = time.monotonic()
    while not process_ended(pids[last]) and time.monotonic() - started < EXIT_WAIT:
        time.sleep(0.02)
    check = check_survivors
    check.check(process_ended(pids[last]), f"rank {last} (pid {pids[last]}) still running "
                f"{EXIT_WAIT:g} s after it left main: its exit waited for the others")
    # Read from the board on its host; from its host's crash witness elsewhere, which lives on
    # while another rank of that host does.
    if hosts[last] == hosts[pg.rank] or hosts.count(hosts[last]) > 1:
        text = pg.progress.laggards(pg.seq + 1, "allreduce")
        named = f"rank {last} on host {hosts[last]}" if pg.topology.spans_hosts else f"rank {last}"
        check.check(f"{named} (its process exited" in text, f"board of rank {pg.rank}: {text!r}")
    data = np.ones(5)
    survivors.allreduce(data)
    check.equal(data, np.full(5, float(last)), "allreduce of the survivors")


def main():
    mode = sys.argv[1]
    if mode == "torch":
        import torch
        import torch.distributed as dist

        import autograd_bridge

        autograd_bridge.init_process_group()
        rank, size = dist.get_rank(), dist.get_world_size()
        check = Checker()
        tensor = torch.full((7,), float(rank + 1))
        dist.all_reduce(tensor)
        check.equal(tensor.numpy(), np.full(7, size * (size + 1) / 2), "dist.all_reduce")
        pair = dist.new_group([0, 1])
        if rank < 2:
            tensor = torch.ones(3)
            dist.all_reduce(tensor, group=pair)
            check.equal(tensor.numpy(), np.full(3, 2.0), "all_reduce on a torch subgroup")
        check.finish()
        return
    pg = commlib.init(timeout=60)
    if mode == "early":
        # The verdict among the survivors only: the last rank will be gone.
        check = Checker(MPI.COMM_WORLD.Split(0 if pg.rank < pg.size - 1 else MPI.UNDEFINED, pg.rank)
                        if pg.size > 1 else MPI.COMM_WORLD)
        early_exit(pg, check)
        check.finish()
        return
    check = Checker()
    data = np.full(9, pg.rank + 1, np.int64)
    pg.allreduce(data)
    check.equal(data, np.full(9, pg.size * (pg.size + 1) // 2), "allreduce")
    if mode == "subgroup":
        odd = pg.new_group([r for r in range(pg.size) if r % 2 == 1])
        check.check((odd is None) == (pg.rank % 2 == 0), "new_group membership")
        if odd is not None:
            data = np.ones(4, np.int64)
            odd.allreduce(data)
            check.equal(data, np.full(4, odd.size), "allreduce on the subgroup")
    check.finish()


if __name__ == "__main__":
    main()
