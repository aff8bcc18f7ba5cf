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
* ``diloco`` / ``streaming-diloco`` / ``desloc``: :func:`ddp.low_communication.low_communication`
  with the papers' settings, H = ``--period`` (DES-LOC: ``(H, 3H, 6H)`` around Adam, whose own
  baseline is ``ddp-adam``: DDP with Adam); ``--steps`` a multiple of ``6 H`` gives DES-LOC's
  bytes per step over whole cycles;
* ``local``: purely local steps, never averaged: not a method but the floor under every one of
  them (compute and the optimizer alone), so a target ratio below ``local``'s is out of reach on
  that machine whatever the link.

The methods are a table (:data:`METHODS`): adding one is a function that sets it up on a fresh
DDP model (its comm hook, its optimizer wrapper, its averager) and one entry.

Each configuration runs in blocks of ``--steps`` consecutive steps (a multiple of the period, so
local SGD's time is amortised over whole periods), built fresh for each block (a few untimed
warm-up steps first, past the start of compression or local steps) and freed after (DDP's
gradient hooks removed: they would keep the model alive), so one model's memory is alive at a
time. A block ends when its last averaging has completed (the partial averager's last slice is
waited for inside the block, not left to overlap the next one). Configurations take turns block
by block, ``--rounds`` times, so a slow spell of the shared machine hits them alike; the time is
the median over rounds of each block's mean step time, the maximum over ranks. Bytes: payload
handed to collectives per step (DDP's buckets and the averager's allreduces), rank 0. ``waited
ms/step`` (the low-communication methods): the time the loop stood waiting for their
synchronisations (``waited_seconds``), per step, counted like the step time: what overlap did
not hide (streaming DiLoCo's delay should bring it to about zero).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Protocol, Tuple

import torch
import torch.nn.functional as F
from mpi4py import MPI

import commlib
from commlib.bench.record import bench_record, write_record
from commlib.bench.table import Column, format_line, header_line, names

from ddp.averaging import HierarchicalModelAverager, ModelAverager, PartialModelAverager, PeriodicModelAverager
from ddp.bench.models import MODELS, build_model, set_mmap_threshold
from ddp.distributed import DistributedDataParallel
from ddp.hooks import PostLocalSGDState, PowerSGDState, post_localSGD_hook, powerSGD_hook
from ddp.low_communication import low_communication
from ddp.optim import PostLocalSGDOptimizer

__all__ = ["main", "METHODS", "Setup", "columns"]

START = 1  # PowerSGD and local steps from the second step (the first one rebuilds DDP's buckets)



class Averager(Protocol):
    """What a block needs of a method's synchronisation: ``finish()`` waits for its last one (a
    block ends when its communication has), ``bytes_sent`` counts. DiLoCo and DES-LOC are also
    context managers, entered around the block's steps."""

    @property
    def bytes_sent(self) -> int: ...

    def finish(self) -> None: ...


# A method's set-up: (model, its plain SGD optimizer, args, group) -> (the optimizer to step, the
# averager or None). The model is a fresh DistributedDataParallel.
Setup = Callable[[DistributedDataParallel, torch.optim.Optimizer, argparse.Namespace, object],
                 Tuple[torch.optim.Optimizer, Optional[Averager]]]


def _plain(model, optimizer, args, group):
    return optimizer, None


def _powersgd(model, optimizer, args, group):
    model.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=args.rank, start_powerSGD_iter=START),
                             powerSGD_hook)
    return optimizer, None


def _local_steps(model) -> None:
    """Post-local SGD: from step ``START`` on, the gradients stay local."""
    model.register_comm_hook(PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False),
                             post_localSGD_hook)


def _local(model, optimizer, args, group):
    _local_steps(model)
    return optimizer, None


def _averaged(make_averager: Callable[[argparse.Namespace, object], ModelAverager]) -> Setup:
    """Local steps, and the parameters averaged by ``make_averager(args, group)``'s averager."""
    def setup(model, optimizer, args, group):
        _local_steps(model)
        averager = make_averager(args, group)
        return PostLocalSGDOptimizer(optimizer, averager), averager

    return setup


def _adam(model, optimizer, args, group):
    return torch.optim.Adam(model.parameters(), lr=1e-6), None


def _low_communication(name: str) -> Setup:
    """DiLoCo, streaming DiLoCo or DES-LOC (around Adam) after ``START`` steps of DDP."""
    def setup(model, optimizer, args, group):
        if name == "desloc":
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-6)
        return optimizer, low_communication(name, model, optimizer, args.period, warmup_steps=START,
                                            algorithm=args.algorithm)

    return setup


def _hierarchical(args, group) -> ModelAverager:
    ppn = args.ranks_per_host
    levels = {2: ppn, args.period: group.size} if 1 < ppn < group.size else {args.period: group.size}
    return HierarchicalModelAverager(levels, warmup_steps=START)


METHODS: Dict[str, Setup] = {
    "ddp": _plain,
    "powersgd": _powersgd,
    "localsgd": _averaged(lambda args, group: PeriodicModelAverager(args.period, warmup_steps=START)),
    "partial": _averaged(lambda args, group: PartialModelAverager(args.period, warmup_steps=START,
                                                                  schedule="balanced")),
    "partial_rr": _averaged(lambda args, group: PartialModelAverager(args.period, warmup_steps=START,
                                                                     schedule="round_robin")),
    "hierarchical": _averaged(_hierarchical),
    "diloco": _low_communication("diloco"),
    "streaming-diloco": _low_communication("streaming-diloco"),
    "desloc": _low_communication("desloc"),
    "ddp-adam": _adam,
    "local": _local,
}


def build(method, base, args, group):
    """(model, optimizer, averager or None) for ``method`` on a copy of ``base``."""
    model = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap, algorithm=args.algorithm,
                                    gradient_as_bucket_view=not args.no_view)
    optimizer, averager = METHODS[method](model, torch.optim.SGD(model.parameters(), lr=1e-6), args, group)
    return model, optimizer, averager


def one_block(method, base, x, y, args, group):
    """(mean seconds per step, bytes per step, seconds per step waited or None) of one fresh block
    of ``args.steps`` steps; waited: what the method's ``waited_seconds`` counted (the
    low-communication methods), None for the others."""
    model, optimizer, averager = build(method, base, args, group)

    def step():
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        return model.last_step_stats()["bytes_sent"]

    context = averager if isinstance(averager, contextlib.AbstractContextManager) else contextlib.nullcontext()
    with context:
        for _ in range(START + args.warmup):
            step()
        if averager is not None:
            averager.finish()
        sent_before = averager.bytes_sent if averager is not None else 0
        waited_before = getattr(averager, "waited_seconds", None)
        group.comm.Barrier()
        start = time.perf_counter()
        sent = sum(step() for _ in range(args.steps))
        if averager is not None:
            averager.finish()
        elapsed = time.perf_counter() - start
        if averager is not None:
            sent += averager.bytes_sent - sent_before
        waited = None if waited_before is None else (averager.waited_seconds - waited_before) / args.steps
    group.comm.Barrier()
    model.reducer.remove_hooks()
    return elapsed / args.steps, sent / args.steps, waited


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddp.bench --sync", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync", nargs="+", default=["ddp", "powersgd", "localsgd", "partial"],
                        choices=list(METHODS))
    parser.add_argument("--model", default="mlp", choices=MODELS)
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
    parser.add_argument("--json", default=None, help="also write the rows to this file (rank 0; commlib.bench.record)")
    return parser


def columns(reference: str) -> tuple:
    """The table's columns; the ratios are to the first method, ``reference``."""
    return (Column("sync", 12, "s"), Column("ms/step", 9, ".1f"), Column("vs " + reference, 8, ".2f"),
            Column("MB/step", 9, ".3f"), Column("bytes vs", 9, ".4f", "n/a"),
            Column("waited ms/step", 15, ".1f", "n/a"),
            Column("blocks (ms/step)", 20, lambda blocks: " ".join(f"{ms:.0f}" for ms in blocks)))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
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
    waits: Dict[str, List[float]] = {method: [] for method in args.sync}
    sent = {}
    for round_index in range(args.rounds):
        order = args.sync[round_index % len(args.sync):] + args.sync[:round_index % len(args.sync)]
        for method in order:
            seconds, per_step, waited = one_block(method, base, x, y, args, group)
            gc.collect()  # the block's model is gone: one model's memory alive at a time
            assert group.comm is not None  # the benchmark runs under mpiexec
            samples[method].append(group.comm.allreduce(seconds, op=MPI.MAX))
            if waited is not None:  # the slowest rank's, as for the step time
                waits[method].append(group.comm.allreduce(waited, op=MPI.MAX))
            sent[method] = per_step
    if group.rank == 0:
        rows = make_rows(args, samples, sent, waits)
        print_table(args, group, base, rows)
        if args.json:
            write_record(args.json, bench_record("ddp.bench --sync", module="ddp.bench", argv=argv,
                                                 world_size=group.size, columns=names(columns(args.sync[0])),
                                                 rows=rows))


def make_rows(args, samples, sent, waits) -> List[dict]:
    """One row per method, keyed by the table's columns (and the model); ``waits``: per method
    the seconds per step waited in each block (empty: not counted)."""
    reference = args.sync[0]
    reference_time, reference_bytes = statistics.median(samples[reference]), sent[reference]
    rows = []
    for method in args.sync:
        median = statistics.median(samples[method])
        rows.append({"sync": method, "ms/step": median * 1e3, "vs " + reference: median / reference_time,
                     "MB/step": sent[method] / 1e6,
                     "bytes vs": sent[method] / reference_bytes if reference_bytes else None,
                     "waited ms/step": statistics.median(waits[method]) * 1e3 if waits[method] else None,
                     "blocks (ms/step)": [s * 1e3 for s in samples[method]], "model": args.model})
    return rows


def print_table(args, group, base, rows) -> None:
    params = sum(p.numel() for p in base.parameters())
    print(f"# ddp.bench --sync model={args.model} ({params / 1e6:.1f}M parameters) P={group.size} "
          f"rank={args.rank} period={args.period} steps/block={args.steps} rounds={args.rounds} "
          f"threads={args.threads} bucket_cap={args.bucket_cap}MB gradient_as_bucket_view={not args.no_view}")
    table = columns(args.sync[0])
    print(header_line(table))
    for row in rows:
        print(format_line(table, row), flush=True)
