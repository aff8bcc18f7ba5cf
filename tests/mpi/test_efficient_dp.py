"""Communication-efficient data parallelism under real mpiexec: local SGD and the averagers,
PowerSGD, Join with uneven inputs, resuming from checkpoints (the efficient_dp_*_ranks.py
docstrings say what each checks), in the session's job of torch scripts per world size
(tests/support/torch_job.py)."""

import pytest

from tests.support.mpirun import world_sizes
from tests.support.torch_job import TORCH_JOB

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", world_sizes(2, 3, full=(4,)))
def test_local_sgd_and_averagers_are_exact(nprocs):
    TORCH_JOB.check(nprocs, "efficient_dp_local_sgd_ranks.py")


@pytest.mark.parametrize("nprocs", (2, 3))
def test_powersgd_exact_bytes_and_equal_to_torch(nprocs):
    TORCH_JOB.check(nprocs, "efficient_dp_powersgd_ranks.py")


@pytest.mark.parametrize("nprocs", (2, 3))
def test_join_with_uneven_inputs(nprocs):
    TORCH_JOB.check(nprocs, "efficient_dp_join_ranks.py")


def test_resume_from_checkpoint_is_bitwise():
    TORCH_JOB.check(2, "efficient_dp_resume_ranks.py")
