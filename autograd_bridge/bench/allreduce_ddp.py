"""torch.distributed over "commlib" vs over gloo: allreduce latency and torch DDP step time.

Run by ``python -m autograd_bridge.bench`` (:mod:`.__main__`).

Part 1: ``dist.all_reduce(t)`` (float32, sum, sync) from 8 B to 1 MiB, on the default "commlib"
group and on a gloo group of the same ranks. A sample is the mean of ``iters`` back-to-back calls
after a barrier; the table shows the median of the samples, the ratio gloo/commlib, busbw
(algbw * 2(P-1)/P) and #wrong (a check call with rank-derived values before timing).

Part 2: torch's own DistributedDataParallel on a 25M-parameter MLP (1024-4096-4096-1024, batch
128 per rank, torch.set_num_threads(1), SGD), the same model and data on both backends, steps
taking turns between them (``commlib.bench.timing.step_in_turn``, shared with ``ddp.bench``); the
median step time (forward + backward + optimizer) of rank 0.

The functions ``allreduce_latency`` and ``ddp_step_times`` take any torch process group, for use
by other benchmark scripts.
"""

from __future__ import annotations

import statistics
import time
from typing import Dict

import torch
import torch.distributed as dist

from commlib.bench.timing import step_in_turn

__all__ = ["SIZES", "MLP_WIDTHS", "allreduce_latency", "make_mlp", "ddp_step_times"]

SIZES = (8, 64, 512, 4096, 8192, 65536, 1 << 20)
MLP_WIDTHS = (1024, 4096, 4096, 1024)


def allreduce_latency(group, nbytes: int, samples: int = 15, iters: int = 0) -> tuple:
    """(median seconds per dist.all_reduce, #wrong elements) for ``nbytes`` of float32."""
    count = max(1, nbytes // 4)
    iters = iters or max(5, min(300, (1 << 22) // max(nbytes, 1) // 8))
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    check = torch.full((count,), float(rank + 1))
    dist.all_reduce(check, group=group)
    wrong = int((check != size * (size + 1) / 2).sum())
    t = torch.zeros(count)  # zeros stay zeros: repeated sums cannot overflow
    for _ in range(10):
        dist.all_reduce(t, group=group)
    times = []
    for _ in range(samples):
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t, group=group)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times), wrong


def make_mlp(widths=MLP_WIDTHS, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def ddp_step_times(groups: dict, steps: int = 5, warmup: int = 2, batch: int = 128,
                   widths=MLP_WIDTHS) -> dict:
    """{name: [seconds per step]} for torch DDP over each group; steps take turns (``step_in_turn``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    data = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, widths[0], generator=data)
    target = torch.randn(batch, widths[-1], generator=data)
    optimizers: Dict[str, torch.optim.Optimizer] = {}

    def step(name, model):
        optimizer = optimizers.get(name)
        if optimizer is None:
            optimizer = optimizers[name] = torch.optim.SGD(model.parameters(), lr=1e-3)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), target).backward()
        optimizer.step()

    factories = {name: (lambda group=group: DDP(make_mlp(widths), process_group=group))
                 for name, group in groups.items()}
    times = step_in_turn(factories, step, dist.barrier, steps, warmup)
    optimizers.clear()
    return times
