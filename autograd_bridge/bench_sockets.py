"""commlib's socket transport vs gloo vs MPI, allreduce on one host, in one job.

    mpiexec -n 2 python -m autograd_bridge.bench_sockets [--sizes 8,64M] [--tls] [--json out.json]

What ``python -m commlib.bench.sockets`` prints (see there), with gloo in the table: torch's own
``dist.all_reduce`` on a gloo group of the same ranks (a tensor sharing the benchmark's buffer),
taking turns with the other contenders call by call. Here because it needs torch, which commlib
never imports.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commlib.bench import sockets


def gloo_contender(comm):
    """Start a gloo process group over this MPI job's ranks; return ``extra(buf)`` for the bench."""
    rank, size = comm.Get_rank(), comm.Get_size()
    master = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False) if rank == 0 else None
    port = comm.bcast(master.port if master is not None else None, root=0)
    store = master if master is not None else dist.TCPStore("127.0.0.1", port, size, False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size)

    def extra(buf):
        tensor = torch.from_numpy(buf)
        return {"gloo": lambda: dist.all_reduce(tensor)}

    return extra


def main(argv=None) -> None:
    torch.set_num_threads(1)
    try:
        sockets.main(argv, extra=gloo_contender, extra_note="; gloo through torch.distributed")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
