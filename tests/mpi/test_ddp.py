"""DDP under real mpiexec: equivalence with one process on the whole batch, features, error paths.

Each script runs many cases in one launch, and the three share one job per world size (starting
torch on P ranks costs more than most of the cases).
"""

import pytest

from tests.support.mpirun import Job, Part, run_mpi

pytestmark = pytest.mark.mpi

# ddp_errors_ranks.py last: it registers a failing allreduce algorithm for the rest of its process.
DDP = Job(Part("ddp_equivalence_ranks.py"), Part("ddp_features_ranks.py"), Part("ddp_errors_ranks.py"), timeout=400)


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_ddp_equivalence(nprocs):
    DDP.check(nprocs, "ddp_equivalence_ranks.py")


@pytest.mark.full
def test_ddp_equivalence_four_ranks():
    run_mpi("ddp_equivalence_ranks.py", 4, "mlp", "unused", "no_sync", timeout=180)


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_ddp_features(nprocs):
    DDP.check(nprocs, "ddp_features_ranks.py")


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_ddp_errors(nprocs):
    DDP.check(nprocs, "ddp_errors_ranks.py")
