"""PYTHONPATH=. mpiexec -n 3 python tests/mpi/torch_functional_ranks.py

Differentiable collectives (autograd_bridge.functional): values, and gradients across ranks.

gradcheck for a function of the inputs of *all* ranks: the P ranks' inputs form one vector X and
the outputs one vector Y. The numerical Jacobian perturbs one element of one rank's input at a
time (the other ranks pass theirs unchanged) and every rank records how its output moved; the
analytic Jacobian back-propagates a unit vector from one output element of one rank (zeros on
the others) and every rank records its input's gradient. Both full matrices are gathered and
compared, so a backward that is right on its own rank but wrong across ranks is caught.
"""



import numpy as np
import torch
from mpi4py import MPI

import commlib
from autograd_bridge import functional as F
from tests.support.verdict import Checker

torch.set_num_threads(1)
EPS = 1e-6


def base_input(rank, n):
    return torch.linspace(-1.0, 1.0, n, dtype=torch.float64) * (rank + 1) + 0.25 * rank


def jacobians(fn, n, comm):
    """(numerical, analytic) Jacobians d Y / d X over all ranks, each (P*m, P*n)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    x0 = base_input(rank, n)
    m = fn(x0).numel()
    numerical_cols = np.zeros((m, size * n))  # this rank's output rows
    for s in range(size):
        for j in range(n):
            plus, minus = x0.clone(), x0.clone()
            if rank == s:
                plus[j] += EPS
                minus[j] -= EPS
            numerical_cols[:, s * n + j] = ((fn(plus) - fn(minus)) / (2 * EPS)).reshape(-1).numpy()
    analytic_rows = np.zeros((size * m, n))  # this rank's input columns
    for r in range(size):
        for i in range(m):
            x = x0.clone().requires_grad_(True)
            y = fn(x).reshape(-1)
            seed = torch.zeros(m, dtype=torch.float64)
            if rank == r:
                seed[i] = 1.0
            y.backward(seed)
            analytic_rows[r * m + i] = x.grad.numpy()
    numerical = np.concatenate(comm.allgather(numerical_cols), axis=0)
    analytic = np.concatenate(comm.allgather(analytic_rows), axis=1)
    return numerical, analytic


def main():
    group = commlib.init()
    comm = MPI.COMM_WORLD
    rank, size = group.rank, group.size
    checker = Checker()
    n = 2 * size  # divisible by the group size, for reduce_scatter
    cases = {
        "all_reduce sum": lambda x: F.all_reduce(x),
        "all_reduce avg": lambda x: F.all_reduce(x, "avg"),
        "all_gather": lambda x: F.all_gather(x),
        "reduce_scatter sum": lambda x: F.reduce_scatter(x),
        "reduce_scatter avg": lambda x: F.reduce_scatter(x, "avg"),
        "broadcast from last": lambda x: F.broadcast(x, size - 1),
        "reduce to 0": lambda x: F.reduce(x, 0),
        # A composition: the chain rule through two collectives and a local nonlinearity.
        "all_gather . tanh . reduce_scatter": lambda x: F.all_gather(torch.tanh(F.reduce_scatter(x))),
    }
    for name, fn in cases.items():
        numerical, analytic = jacobians(fn, n, comm)
        checker.close(analytic, numerical, f"{name}: analytic vs numerical Jacobian", rtol=1e-6, atol=1e-8)
        checker.check(np.abs(analytic).sum() > 0, f"{name}: the Jacobian is all zeros")

    # Forward values in closed form.
    everyone = torch.stack([base_input(r, n) for r in range(size)])
    x = base_input(rank, n)
    checker.close(F.all_reduce(x).numpy(), everyone.sum(0).numpy(), "all_reduce value")
    checker.close(F.all_gather(x.reshape(2, size)).numpy(), everyone.reshape(2 * size, size).numpy(),
                  "all_gather value")
    checker.close(F.reduce_scatter(x).numpy(), everyone.sum(0)[rank * 2:(rank + 1) * 2].numpy(), "reduce_scatter value")
    checker.close(F.broadcast(x, size - 1).numpy(), everyone[size - 1].numpy(), "broadcast value")
    checker.close(x.numpy(), base_input(rank, n).numpy(), "inputs are left untouched (out-of-place)")

    # Second order: L = sum(all_reduce(x)^2); g = dL/dx = 2P * sum_s x_s on every rank;
    # d(sum of g over this rank)/dx_r summed through the ranks' graphs = 2 P^2 everywhere.
    x = base_input(rank, n).requires_grad_(True)
    (grad,) = torch.autograd.grad(F.all_reduce(x).pow(2).sum(), x, create_graph=True)
    checker.close(grad.detach().numpy(), (2 * size * everyone.sum(0)).numpy(), "first derivative")
    grad.sum().backward()
    checker.close(x.grad.numpy(), np.full(n, 2.0 * size * size), "second derivative")

    checker.raises(commlib.InvalidUsageError, lambda: F.all_reduce(x, "max"), "all_reduce MAX", match="SUM or AVG")
    indivisible = torch.ones(size + 1) if size > 1 else torch.ones(())
    checker.raises(commlib.InvalidUsageError, lambda: F.reduce_scatter(indivisible),
                   "reduce_scatter of an indivisible input", match="divisible")
    checker.raises(commlib.InvalidUsageError, lambda: F.broadcast(x, size), "broadcast from a missing rank",
                   match="out of range")
    checker.finish()


if __name__ == "__main__":
    main()
