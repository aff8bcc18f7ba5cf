"""One order of collectives on every rank, whatever thread issues them (commlib/executor.py)."""

import pytest

from mpirun import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_torch_powersgd_with_six_buckets_in_flight_keeps_ranks_identical(nprocs):
    result = run_mpi("powersgd_buckets.py", nprocs, timeout=180)
    assert "OK:" in result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_collectives_issued_from_callbacks_keep_one_order(nprocs):
    result = run_mpi("callback_order.py", nprocs, timeout=180)
    assert "OK:" in result.stdout
