"""Communication-efficient data parallelism under real mpiexec: local SGD and the averagers,
PowerSGD, Join with uneven inputs, resuming from checkpoints (tests/mpi/*_check.py docstrings)."""

import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", (2, 3, 4))
def test_local_sgd_and_averagers_are_exact(nprocs):
    run_mpi("local_sgd_exact.py", nprocs, timeout=180)


@pytest.mark.parametrize("nprocs", (2, 3))
def test_powersgd_exact_bytes_and_equal_to_torch(nprocs):
    run_mpi("powersgd_check.py", nprocs, timeout=180)


@pytest.mark.parametrize("nprocs", (2, 3))
def test_join_with_uneven_inputs(nprocs):
    run_mpi("join_check.py", nprocs, timeout=180)


def test_resume_from_checkpoint_is_bitwise():
    run_mpi("resume_check.py", 2, timeout=180)
