"""autograd_bridge under real mpiexec: the "commlib" torch.distributed backend's collectives, its
point-to-point and all-to-all, torch's own DDP on it against gloo, and the differentiable
collectives (values and cross-rank Jacobians), and what torch's profiler records of the backend.
The scripts run in the session's job of torch scripts per world size (tests/support/torch_job.py)."""

import pytest

from tests.support.torch_job import TORCH_JOB

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_torch_collectives_closed_form(nprocs):
    TORCH_JOB.check(nprocs, "torch_collectives_ranks.py")


@pytest.mark.parametrize("nprocs", (2, 3))
def test_torch_ddp_matches_gloo(nprocs):
    # P=2: bitwise equal to gloo; P=3: allclose (the script decides from the world size).
    TORCH_JOB.check(nprocs, "torch_ddp_ranks.py")


@pytest.mark.parametrize("nprocs", (2, 3))
def test_torch_point_to_point_and_all_to_all_match_gloo(nprocs):
    # Also a two-stage pipeline-parallel training step and a mixture-of-experts token exchange.
    TORCH_JOB.check(nprocs, "torch_exchange_ranks.py")


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_functional_collectives_gradients(nprocs):
    TORCH_JOB.check(nprocs, "torch_functional_ranks.py")


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_profiler_sees_each_collective_as_gloo_s(nprocs):
    # One async event commlib:<collective> per call with the inputs' shapes; results exact under
    # the profiler; DDP's all_reduce events; all_gather_coalesced in torch's layout.
    TORCH_JOB.check(nprocs, "torch_profiling_ranks.py")
