"""Every public collective under real mpiexec, one run per world size (8 is oversubscribed)."""

import pytest

from mpirun import WORLD_SIZES, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", WORLD_SIZES)
def test_collectives_native_and_auto(nprocs):
    run_mpi("collectives_check.py", nprocs, "auto", "native", timeout=240)
