"""commlib.gpu under mpiexec: what can be checked without a GPU runs everywhere, the rest is
marked ``gpu``.

Without a GPU: the preflight decision with fabricated records exchanged over real MPI, the "CuPy
array on a rank without a GPU" error through the whole group path, the host-staged transport
with a numpy stager, and the backend's control flow with a host stand-in for CuPy
(tests/support/gpu_standin). With a GPU (``-m gpu``): the scripts that ``scripts/gpu_check.sh``
runs. In one process: tests/unit/test_gpu.py.
"""

import pytest

from tests.support.gpu import HAS_GPU
from tests.support.mpirun import ROOT, run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", (1, 2, 3, 4))
def test_preflight_host_staged_and_no_gpu_path_under_mpi(nprocs):
    run_mpi("gpu_nogpu_ranks.py", nprocs, timeout=120)


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_backend_control_flow_with_cupy_standin_under_mpi(nprocs):
    """The backend's flow with tests/support/gpu_standin (host stand-in for CuPy; no CUDA semantics)."""
    standin = ROOT / "tests" / "support" / "gpu_standin"
    run_mpi("gpu_standin_ranks.py", nprocs, timeout=120, env={"PYTHONPATH": str(standin)})


# -- GPU -------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with cupy")


@pytest.mark.gpu
@needs_gpu
def test_gpu_nccl_single_rank():
    run_mpi("gpu_collectives_ranks.py", 1, "nccl", timeout=180)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("nprocs", (2, 4))
def test_gpu_host_staged(nprocs):
    run_mpi("gpu_collectives_ranks.py", nprocs, "host_staged", timeout=240)


@pytest.mark.gpu
@needs_gpu
def test_gpu_ddp_host_staged():
    pytest.importorskip("torch")
    run_mpi("gpu_ddp_ranks.py", 2, "host_staged", timeout=180)


@pytest.mark.gpu
@needs_gpu
def test_gpu_stream_overlap_and_watchdog():
    run_mpi("gpu_overlap_ranks.py", 1, "nccl", timeout=120)


@pytest.mark.gpu
@needs_gpu
def test_gpu_duplicate_preflight_error():
    run_mpi("gpu_duplicate_ranks.py", 2, timeout=120)
