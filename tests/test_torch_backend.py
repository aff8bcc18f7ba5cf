"""The "commlib" torch.distributed backend under real mpiexec: collectives, torch's DDP vs gloo."""

import pytest

from mpirun import run_mpi

pytest.importorskip("torch")


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_torch_collectives_closed_form(nprocs):
    run_mpi("torch_backend_collectives.py", nprocs, timeout=120)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", (2, 3))
def test_torch_ddp_matches_gloo(nprocs):
    # P=2: bitwise equal to gloo; P=3: allclose (the script decides from the world size).
    run_mpi("torch_backend_ddp.py", nprocs, timeout=180)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", (2, 3))
def test_torch_point_to_point_and_all_to_all_match_gloo(nprocs):
    # Also a two-stage pipeline-parallel training step and a mixture-of-experts token exchange.
    result = run_mpi("torch_backend_exchange.py", nprocs, timeout=180)
    assert "OK:" in result.stdout
