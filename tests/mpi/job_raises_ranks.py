"""PYTHONPATH=. mpiexec -n P python tests/mpi/job_raises_ranks.py

P >= 2. Rank 0 raises while the others wait for it in a collective: commlib aborts the job
(test_job.py).
"""

import commlib

if __name__ == "__main__":
    pg = commlib.init(timeout=60)
    if pg.rank == 0:
        raise ValueError("rank 0 raises on purpose")
    pg.barrier()
