"""One order of collectives on every rank, whatever thread issues them (commlib/execution/executor.py).

The three scripts share one job per world size."""

import pytest

from tests.support.mpirun import Job, Part

pytestmark = pytest.mark.mpi

ORDERING = Job(Part("ordering_powersgd_ranks.py", sizes=(2, 3)), Part("ordering_callbacks_ranks.py"),
               Part("ordering_empty_ranks.py", sizes=(2, 3)), timeout=360)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_torch_powersgd_with_six_buckets_in_flight_keeps_ranks_identical(nprocs):
    ORDERING.check(nprocs, "ordering_powersgd_ranks.py")


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_collectives_issued_from_callbacks_keep_one_order(nprocs):
    ORDERING.check(nprocs, "ordering_callbacks_ranks.py")


@pytest.mark.parametrize("nprocs", [2, 3])
def test_an_empty_collective_keeps_ranks_in_step_whichever_path_each_takes(nprocs):
    ORDERING.check(nprocs, "ordering_empty_ranks.py")
