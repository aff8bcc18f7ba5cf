"""One order of collectives on every rank, whatever thread issues them (commlib/execution/executor.py).

The three scripts run in the session's job of torch scripts per world size (tests/support/torch_job.py)."""

import pytest

from tests.support.torch_job import TORCH_JOB

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", [2, 3])
def test_torch_powersgd_with_six_buckets_in_flight_keeps_ranks_identical(nprocs):
    TORCH_JOB.check(nprocs, "ordering_powersgd_ranks.py")


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_collectives_issued_from_callbacks_keep_one_order(nprocs):
    TORCH_JOB.check(nprocs, "ordering_callbacks_ranks.py")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_an_empty_collective_keeps_ranks_in_step_whichever_path_each_takes(nprocs):
    TORCH_JOB.check(nprocs, "ordering_empty_ranks.py")
