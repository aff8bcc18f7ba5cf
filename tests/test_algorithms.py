"""The allreduce schedules under real mpiexec at world sizes 1, 2, 3, 4, 8 (8 oversubscribed).

Tiny segments (16 bytes) make the pipelined paths run on short inputs; the script also checks
that random-float results are bit-identical on every rank.
"""

import pytest

from mpirun import WORLD_SIZES, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", WORLD_SIZES)
def test_algorithms_under_mpiexec(nprocs):
    run_mpi("algorithms_check.py", nprocs, "16", timeout=120)
