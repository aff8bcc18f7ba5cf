"""Communication-efficient data parallelism under real mpiexec: local SGD and the averagers,
PowerSGD, Join with uneven inputs, resuming from checkpoints (the efficient_dp_*_ranks.py
docstrings say what each checks). The scripts share one job per world size."""

import pytest

from tests.support.mpirun import Job, Part, world_sizes

pytestmark = pytest.mark.mpi

EFFICIENT_DP = Job(Part("efficient_dp_local_sgd_ranks.py", sizes=(2, 3, 4)),
                   Part("efficient_dp_powersgd_ranks.py", sizes=(2, 3)),
                   Part("efficient_dp_join_ranks.py", sizes=(2, 3)),
                   Part("efficient_dp_resume_ranks.py", sizes=(2,)), timeout=500)


@pytest.mark.parametrize("nprocs", world_sizes(2, 3, full=(4,)))
def test_local_sgd_and_averagers_are_exact(nprocs):
    EFFICIENT_DP.check(nprocs, "efficient_dp_local_sgd_ranks.py")


@pytest.mark.parametrize("nprocs", (2, 3))
def test_powersgd_exact_bytes_and_equal_to_torch(nprocs):
    EFFICIENT_DP.check(nprocs, "efficient_dp_powersgd_ranks.py")


@pytest.mark.parametrize("nprocs", (2, 3))
def test_join_with_uneven_inputs(nprocs):
    EFFICIENT_DP.check(nprocs, "efficient_dp_join_ranks.py")


def test_resume_from_checkpoint_is_bitwise():
    EFFICIENT_DP.check(2, "efficient_dp_resume_ranks.py")
