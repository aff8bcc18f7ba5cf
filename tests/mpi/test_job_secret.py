"""The job secret under mpiexec: one for every rank, shared over MPI by ``commlib.init()``."""

import pytest

from tests.support.mpirun import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["configured", "generated", "differ", "partial", "short"])
@pytest.mark.parametrize("nprocs", [2, 3])
def test_init_shares_one_job_secret_over_mpi_or_refuses_on_every_rank(mode, nprocs):
    result = run_mpi("job_secret_ranks.py", nprocs, mode, timeout=120)
    assert "OK:" in result.stdout, result.stdout
