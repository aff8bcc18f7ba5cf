"""DDP under real mpiexec: equivalence with one process on the whole batch, features, error paths.

Each script runs many cases in one launch, in the session's job of torch scripts per world size
(tests/support/torch_job.py).
"""

import pytest

from tests.support.mpirun import run_mpi
from tests.support.torch_job import TORCH_JOB

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_ddp_equivalence(nprocs):
    TORCH_JOB.check(nprocs, "ddp_equivalence_ranks.py")


@pytest.mark.full
def test_ddp_equivalence_four_ranks():
    run_mpi("ddp_equivalence_ranks.py", 4, "mlp", "unused", "no_sync", timeout=180)


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_ddp_features(nprocs):
    TORCH_JOB.check(nprocs, "ddp_features_ranks.py")


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_ddp_errors(nprocs):
    TORCH_JOB.check(nprocs, "ddp_errors_ranks.py")
