"""DDP under real mpiexec: equivalence with one process on the whole batch, features, error paths.

Each script runs many cases in one launch (starting torch on P ranks costs more than the cases).
"""

import pytest

from mpirun import run_mpi

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_ddp_equivalence(nprocs):
    run_mpi("ddp_equivalence.py", nprocs, timeout=180)


def test_ddp_equivalence_four_ranks():
    run_mpi("ddp_equivalence.py", 4, "mlp", "unused", "no_sync", timeout=180)


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_ddp_features(nprocs):
    run_mpi("ddp_features.py", nprocs, timeout=120)


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_ddp_errors(nprocs):
    run_mpi("ddp_errors.py", nprocs, timeout=120)
