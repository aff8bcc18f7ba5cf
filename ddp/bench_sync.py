"""mpiexec -n 2 python -m ddp.bench --sync ddp powersgd localsgd partial [--model mlp] [--period 8]

Step time and bytes sent per step of the communication-efficient methods against plain DDP, side
by side in one run (the comparison that matters on a slow link, e.g. hosts of
``commlib.cluster`` with ``--rate 1gbit``):

* ``ddp``: our DDP, plain gradient averaging;
* ``powersgd``: ``powerSGD_hook`` with ``--rank`` (compressing from step 1);
* ``localsgd``: post-local SGD (purely local steps) + ``PeriodicModelAverager(--period)``;
* ``partial`` / ``partial_rr``: the same with ``PartialModelAverager`` (balanced / round-robin plan);
* ``hierarchical``: ``HierarchicalModelAverager`` averaging within hosts every 2 steps and over
  everyone every ``--period`` (local steps);
* ``local``: purely local steps, never averaged: not a method but the floor under every one of
  them (compute and the optimizer alone), so a target ratio below ``local``'s is out of reach on
  that machine whatever the link.

Each configuration runs in blocks of ``--steps`` consecutive steps (a multiple of the period, so
local SGD's time is amortised over whole periods), built fresh for each block (a few untimed
warm-up steps first, past the start of compression or local steps) and freed after, so one
model's memory is alive at a time. A block ends when its last averaging has completed (the
partial averager's last slice is waited for inside the block, not left to overlap the next one).
Configurations take turns block by block, ``--rounds`` times, so a slow spell of the shared
machine hits them alike; the time is the median over rounds of each block's mean step time, the
maximum over ranks. Bytes: payload handed to collectives per step (DDP's buckets and the
averager's allreduces), rank 0.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from typing import Dict, List

import torch
import torch.nn.functional as F

import commlib

from .averaging import HierarchicalModelAverager, ModelAverager, PartialModelAverager, PeriodicModelAverager
from .bench import build_model, set_mmap_threshold
from .distributed import DistributedDataParallel
from .hooks import PostLocalSGDState, PowerSGDState, post_localSGD_hook, powerSGD_hook
from .optim import PostLocalSGDOptimizer

__all__ = ["main", "METHODS"]

METHODS = ("ddp", "powersgd", "localsgd", "partial", "partial_rr", "hierarchical", "local")
START = 1  # PowerSGD and local steps from the second step (the first one rebuilds DDP's buckets)


def build(method, base, args, group):
    """(model, optimizer, averager or None) for ``method`` on a copy of ``base``."""
    model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap, algorithm=args.algorithm,
                                    gradient_as_bucket_view=not args.no_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    if method == "ddp":
        return model, optimizer, None
    if method == "powersgd":
        model.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=args.rank, start_powerSGD_iter=START),
                                 powerSGD_hook)
        return model, optimizer, None
    model.register_comm_hook(PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False),
                             post_localSGD_hook)
    if method == "local":
        return model, optimizer, None
    averager: ModelAverager
    if method == "localsgd":
        averager = PeriodicModelAverager(args.period, warmup_steps=START)
    elif method == "hierarchical":
        ppn = args.ranks_per_host
        levels = {2: ppn, args.period: group.size} if 1 < ppn < group.size else {args.period: group.size}
        averager = HierarchicalModelAverager(levels, warmup_steps=START)
    else:
        averager = PartialModelAverager(args.period, warmup_steps=START,
                                        schedule="balanced" if method == "partial" else "round_robin")
    return model, PostLocalSGDOptimizer(optimizer, averager), averager


def one_block(method, base, x, y, args, group):
    """(mean seconds per step, bytes per step) of one fresh block of ``args.steps`` steps."""
    model, optimizer, averager = build(method, base, args, group)

    def step():
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        return model.last_step_stats()["bytes_sent"]

    for _ in range(START + args.warmup):
        step()
    if averager is not None:
        averager.finish()
    sent_before = averager.bytes_sent if averager is not None else 0
    group.comm.Barrier()
    start = time.perf_counter()
    sent = sum(step() for _ in range(args.steps))
    if averager is not None:
        averager.finish()
    elapsed = time.perf_counter() - start
    if averager is not None:
        sent += averager.bytes_sent - sent_before
    group.comm.Barrier()
    return elapsed / args.steps, sent / args.steps


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddp.bench --sync", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync", nargs="+", default=["ddp", "powersgd", "localsgd", "partial"], choices=METHODS)
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default per model)")
    parser.add_argument("--rank", type=int, default=2, help="PowerSGD's matrix_approximation_rank")
    parser.add_argument("--period", type=int, default=8, help="H: local steps per averaging period")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per block (default 2 periods)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per block after the first")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bucket-cap", type=float, default=25, help="bucket_cap_mb")
    parser.add_argument("--no-view", action="store_true",
                        help="gradient_as_bucket_view=False (default True for every method: no gradient copies)")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="for the hierarchical averager's small level")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--json", default=None, help="also write the rows to this file (rank 0)")
    args = parser.parse_args(argv)
    args.steps = args.steps or 2 * args.period
    if args.steps % args.period:
        parser.error(f"--steps {args.steps} must be a multiple of --period {args.period}")

    torch.set_num_threads(args.threads)
    set_mmap_threshold(32 << 20)
    group = commlib.init()
    torch.manual_seed(0)
    base, make_batch, default_batch = build_model(args.model)
    torch.manual_seed(1 + group.rank)
    x, y = make_batch(args.batch or default_batch)
    samples: Dict[str, List[float]] = {method: [] for method in args.sync}
    sent = {}
    for round_index in range(args.rounds):
        order = args.sync[round_index % len(args.sync):] + args.sync[:round_index % len(args.sync)]
        for method in order:
            seconds, per_step = one_block(method, base, x, y, args, group)
            gc.collect()  # the block's model is gone: one model's memory alive at a time
            samples[method].append(group.comm.allreduce(seconds, op=__import__("mpi4py").MPI.MAX))
            sent[method] = per_step
    if group.rank == 0:
        print_table(args, group, base, samples, sent)


def print_table(args, group, base, samples, sent) -> None:
    params = sum(p.numel() for p in base.parameters())
    print(f"# ddp.bench --sync model={args.model} ({params / 1e6:.1f}M parameters) P={group.size} "
          f"rank={args.rank} period={args.period} steps/block={args.steps} rounds={args.rounds} "
          f"threads={args.threads} bucket_cap={args.bucket_cap}MB gradient_as_bucket_view={not args.no_view}")
    reference = statistics.median(samples[args.sync[0]])
    reference_bytes = sent[args.sync[0]]
    print(f"{'sync':>12} {'ms/step':>9} {'vs ' + args.sync[0]:>8} {'MB/step':>9} {'bytes vs':>9} "
          f"{'blocks (ms/step)':>20}")
    rows = []
    for method in args.sync:
        median = statistics.median(samples[method])
        row = {"sync": method, "model": args.model, "P": group.size, "ms_per_step": median * 1e3,
               "ratio": median / reference, "mb_per_step": sent[method] / 1e6,
               "bytes_ratio": sent[method] / reference_bytes if reference_bytes else None,
               "blocks_ms": [s * 1e3 for s in samples[method]]}
        rows.append(row)
        blocks = " ".join(f"{s * 1e3:.0f}" for s in samples[method])
        bytes_ratio = f"{row['bytes_ratio']:.4f}" if row["bytes_ratio"] is not None else "n/a"
        print(f"{method:>12} {median * 1e3:>9.1f} {row['ratio']:>8.2f} {sent[method] / 1e6:>9.3f} "
              f"{bytes_ratio:>9} {blocks:>20}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
