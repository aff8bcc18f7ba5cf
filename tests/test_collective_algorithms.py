"""Every algorithm of every collective (not allreduce: test_algorithms.py) under real mpiexec,
at world sizes 1, 2, 3, 4 and 8 (8 oversubscribed); 5..7 run on the in-process transport
(test_collective_schedules.py). Tiny 16-byte segments make the pipelined paths run."""

import pytest

from mpirun import WORLD_SIZES, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", WORLD_SIZES)
def test_collective_algorithms_under_mpiexec(nprocs):
    result = run_mpi("collective_algorithms_check.py", nprocs, "16", timeout=180)
    assert "OK:" in result.stdout
