"""DiLoCo, Streaming DiLoCo and DES-LOC under real mpiexec: one job per world size runs every
exactness check of tests/mpi/low_communication_ranks.py (its docstring lists them)."""

import pytest

from tests.support.mpirun import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_low_communication_methods_equal_their_references(nprocs):
    run_mpi("low_communication_ranks.py", nprocs, timeout=300)
