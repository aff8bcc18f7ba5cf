"""PYTHONPATH=. mpiexec -n 2 python tests/mpi/gpu_duplicate_ranks.py

Two ranks, one GPU, NCCL transport: the first GPU collective raises our GpuSetupError on every
rank, naming both ranks and the GPU (NCCL itself would say "Duplicate GPU detected" on some
ranks and hang on others); the group's CPU collectives keep working.
"""

import cupy
import numpy as np

import commlib
from commlib.gpu import GpuSetupError, attach
from tests.support.verdict import Checker


def main():
    cupy.cuda.Device(0).use()
    pg = commlib.init(timeout=60)
    attach(pg, "nccl")
    check = Checker()
    x = cupy.ones(8, dtype=cupy.float32)
    everyone = ", ".join(map(str, range(pg.size)))
    for attempt in ("first", "second"):
        error = check.raises(GpuSetupError, lambda: pg.allreduce(x), f"{attempt} call", match="would all use GPU 0")
        if error is not None:
            check.check(f"ranks {everyone} on host" in str(error), f"message does not name the ranks: {error}")
            if pg.rank == 0 and attempt == "first":
                print(f"error: {error}", flush=True)
    buf = np.ones(4)
    pg.allreduce(buf)
    check.equal(buf, np.full(4, float(pg.size)), "CPU allreduce after the preflight error")
    check.finish()


if __name__ == "__main__":
    main()
