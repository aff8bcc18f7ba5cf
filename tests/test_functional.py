"""Differentiable collectives: values and cross-rank Jacobians under real mpiexec."""

import pytest

from mpirun import run_mpi

pytest.importorskip("torch")


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", (1, 2, 3))
def test_functional_collectives_gradients(nprocs):
    run_mpi("functional_check.py", nprocs, timeout=120)
