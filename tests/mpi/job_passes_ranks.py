"""PYTHONPATH=. mpiexec -n P python tests/mpi/job_passes_ranks.py [ARG]

A rank script whose checks pass, and that says which argument it got (test_job.py).
"""

import sys

from tests.support.verdict import Checker

if __name__ == "__main__":
    check = Checker()
    check.check(True, "")
    if check.rank == 0:
        print(f"job_passes: argv {sys.argv[1:]}", flush=True)
    check.finish()
