"""autograd_bridge under real mpiexec: the "commlib" torch.distributed backend's collectives, its
point-to-point and all-to-all, torch's own DDP on it against gloo, and the differentiable
collectives (values and cross-rank Jacobians), and what torch's profiler records of the backend.
The scripts share one job per world size."""

import pytest

from tests.support.mpirun import Job, Part

pytest.importorskip("torch")
pytestmark = pytest.mark.mpi

TORCH = Job(Part("torch_collectives_ranks.py"), Part("torch_exchange_ranks.py", sizes=(2, 3)),
            Part("torch_ddp_ranks.py", sizes=(2, 3)), Part("torch_functional_ranks.py"),
            Part("torch_profiling_ranks.py"), timeout=600)


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_torch_collectives_closed_form(nprocs):
    TORCH.check(nprocs, "torch_collectives_ranks.py")


@pytest.mark.parametrize("nprocs", (2, 3))
def test_torch_ddp_matches_gloo(nprocs):
    # P=2: bitwise equal to gloo; P=3: allclose (the script decides from the world size).
    TORCH.check(nprocs, "torch_ddp_ranks.py")


@pytest.mark.parametrize("nprocs", (2, 3))
def test_torch_point_to_point_and_all_to_all_match_gloo(nprocs):
    # Also a two-stage pipeline-parallel training step and a mixture-of-experts token exchange.
    TORCH.check(nprocs, "torch_exchange_ranks.py")


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_functional_collectives_gradients(nprocs):
    TORCH.check(nprocs, "torch_functional_ranks.py")


@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_profiler_sees_each_collective_as_gloo_s(nprocs):
    # One async event commlib:<collective> per call with the inputs' shapes; results exact under
    # the profiler; DDP's all_reduce events; all_gather_coalesced in torch's layout.
    TORCH.check(nprocs, "torch_profiling_ranks.py")
