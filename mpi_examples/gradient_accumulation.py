# mpiexec -n 2 python mpi_examples/gradient_accumulation.py [--micro-batches 4] [--steps 5]
"""Gradient accumulation with ``no_sync``: K small backward passes, one allreduce, same result.

Each rank runs K micro-batches per optimizer step. The first K-1 backward passes run inside
``model.no_sync()``: gradients only accumulate locally and no bucket is sent. The K-th pass
communicates as usual and averages the accumulated gradients over the ranks. With every loss
divided by K, that is exactly the gradient of the mean loss over the big batch (all ranks, all
micro-batches), so the parameters must match a single process trained on the big batch.
"""

import argparse
import contextlib
import copy
import sys

import numpy as np
import torch

import commlib
from ddp import DistributedDataParallel as DDP


def big_batch(step, size, features):
    """The same global batch on every rank (generated from the step number)."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(size, features, generator=generator, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pg = commlib.init()
    torch.manual_seed(0)
    # float64, so the comparison below shows the method is exact rather than "close in float32".
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)).double()
    reference = copy.deepcopy(net)  # one process, the whole big batch per step
    model = DDP(net, bucket_cap_mb=0.002)  # small buckets: several per backward
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    k, m = args.micro_batches, args.micro_batch_size
    silent_collectives = 0
    for step in range(args.steps):
        x, y = big_batch(step, pg.size * k * m, 16)
        mine_x, mine_y = x[pg.rank * k * m:(pg.rank + 1) * k * m], y[pg.rank * k * m:(pg.rank + 1) * k * m]
        optimizer.zero_grad()
        for micro in range(k):
            last = micro == k - 1
            issued_before = pg.seq
            with (contextlib.nullcontext() if last else model.no_sync()):
                xs, ys = mine_x[micro * m:(micro + 1) * m], mine_y[micro * m:(micro + 1) * m]
                loss = torch.nn.functional.mse_loss(model(xs), ys) / k
                loss.backward()
            if not last:
                silent_collectives += pg.seq - issued_before
        optimizer.step()

        reference_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        reference_optimizer.step()

    difference = max((a - b).abs().max().item() for a, b in zip(model.module.parameters(), reference.parameters()))
    worst = np.array([difference, float(silent_collectives)])
    pg.allreduce(worst, commlib.ReduceOp.MAX)
    ok = worst[0] < 1e-10 and worst[1] == 0
    if pg.rank == 0:
        print(f"{pg.size} ranks x {k} micro-batches of {m}, {args.steps} steps: largest parameter difference "
              f"to one process on the big batch {worst[0]:.3g}; collectives issued inside no_sync: {int(worst[1])}")
        print("same parameters as the big batch" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
