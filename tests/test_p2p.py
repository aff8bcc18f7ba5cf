"""Point-to-point (send/recv/isend/irecv, ANY_SOURCE, monitored_barrier) under real mpiexec."""

import pytest

from mpirun import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", (2, 3))
def test_point_to_point_under_mpiexec(nprocs):
    result = run_mpi("p2p_check.py", nprocs, timeout=120)
    assert "OK:" in result.stdout
