"""PYTHONPATH=. mpiexec -n P python tests/mpi/job_fails_ranks.py

P >= 2. A rank script whose one check fails on rank 1 only: every rank exits 1 (test_job.py).
"""

from tests.support.verdict import Checker

if __name__ == "__main__":
    check = Checker()
    check.check(check.rank != 1, "rank 1 fails on purpose")
    check.finish()
