"""DiLoCo, Streaming DiLoCo and DES-LOC under real mpiexec: every exactness check of
tests/mpi/low_communication_ranks.py (its docstring lists them), in the session's job of torch
scripts per world size (tests/support/torch_job.py)."""

import pytest

from tests.support.torch_job import TORCH_JOB

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_low_communication_methods_equal_their_references(nprocs):
    TORCH_JOB.check(nprocs, "low_communication_ranks.py")
