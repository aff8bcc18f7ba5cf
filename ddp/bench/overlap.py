"""mpiexec -n 2 python -m ddp.bench --model mlp --caps 1 5 25 100

(With ``--sync ddp powersgd localsgd partial ...``: step time and bytes of PowerSGD and local SGD
against DDP instead, see :mod:`ddp.bench.sync`.)

Step time (forward + backward + SGD step; the median over ``--steps`` turns after ``--warmup``,
repeated ``--rounds`` times, of steps taken in turn by every configuration of one bucket cap,
all alive at once) of one model and per-rank batch, side by side in one run:

* ``ours``: ``ddp.DistributedDataParallel`` (``gradient_as_bucket_view`` False, and True as ``view``)
* ``gloo``: torch's own DDP over gloo (a TCP store on 127.0.0.1, port from rank 0 over mpi4py)
* ``t/cl``: torch's own DDP over the ``"commlib"`` torch.distributed backend
  (``autograd_bridge.backend``), n/a when that module cannot be imported or fails
* ``nosync``: our DDP inside ``no_sync()`` (the same work, no communication), and ``local``: the
  plain module, one process
* ``mpi``: our DDP on a group with shared memory turned off (``COMMLIB_SHM=0`` for that group:
  buckets in private memory, every byte through MPI), the baseline for ``cost/mpi``: our DDP's
  time over ``nosync`` divided by the MPI-only one's

``hidden``: fraction of our allreduce time that ran before backward ended (median of
``last_step_stats()``). Memory: ``bufs/g`` is the bytes of the bucket buffers our DDP allocates
over the model's gradient bytes; ``extra/g`` subtracts the gradients that *are* those buffers
(gradient_as_bucket_view), i.e. what DDP adds on top of the local model's parameters + grads.
``rss+/g``: measured, not computed: the peak growth of this process's resident set from just
before building the model to just after each of two backwards (grads alive), DDP's minus the
local model's, over gradient bytes, in a separate pass before the step times (each model
alone; glibc's mmap threshold pinned so freed tensors leave the RSS, see set_mmap_threshold).
``pss+/g``: the same for the proportional set size, which counts a page mapped by ``k``
processes as ``1/k`` (the RSS counts the peers' shared buckets this rank reads in full, as if
each rank had its own copy).
Step times are the maximum over ranks of each rank's median.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
from datetime import timedelta
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from mpi4py import MPI

import commlib
from commlib.bench.record import bench_record, write_record
from commlib.bench.table import Column, format_line, header_line, names
from commlib.bench.timing import step_in_turn

from ddp.bench.models import MODELS, build_model, pss_bytes, rss_bytes, set_mmap_threshold
from ddp.distributed import DistributedDataParallel

__all__ = ["main", "COLUMNS"]

COLUMNS = (Column("cap MB", 6, "g"), Column("view", 5, "s"), Column("bkts", 4, "d"), Column("ours ms", 8, ".1f"),
           Column("mpi ms", 8, ".1f", "n/a"), Column("gloo ms", 8, ".1f"), Column("t/cl ms", 8, ".1f", "n/a"),
           Column("nosync", 7, ".1f"), Column("local", 7, ".1f"), Column("ours/gloo", 9, ".2f"),
           Column("cost/mpi", 8, ".2f", "n/a"), Column("hidden", 6, ".2f", "n/a"), Column("bufs/g", 6, ".2f"),
           Column("extra/g", 7, ".2f"), Column("rss+/g", 6, ".2f"), Column("pss+/g", 6, ".2f"))


def memory_and_layout(make_model, x, y, *, stats=False):
    """Peak RSS growth (bytes) over building the model and two steps, and (``stats``) its buckets."""
    baseline, pss_baseline = rss_bytes(), pss_bytes()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    rss = pss = 0
    for _ in range(2):
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        rss = max(rss, rss_bytes() - baseline)
        pss = max(pss, pss_bytes() - pss_baseline)
        opt.step()
    info = {"buckets": model.bucket_sizes() if stats else None,
            "aliased": sum(p.numel() * p.element_size() for p in model.parameters()
                           if stats and model.gradient_as_bucket_view and p.grad is not None),
            "pss": pss}
    del model, opt
    return rss, info


def interleaved_steps(factories, x, y, steps: int, warmup: int, samples, hidden_samples, comm) -> None:
    """Build every model of ``factories``, then step them in turn; append step times (s) to ``samples``.

    The turns are ``commlib.bench.timing.step_in_turn``'s (a barrier before each step, the first
    configuration rotating); ``hidden_samples`` gets our DDP's hidden fraction of each timed step.
    """
    optimizers: Dict[object, torch.optim.Optimizer] = {}

    def step(key, model):
        optimizer = optimizers.get(key)
        if optimizer is None:
            optimizer = optimizers[key] = torch.optim.SGD(model.parameters(), lr=1e-6)
        optimizer.zero_grad()
        if key == ("nosync",):
            with model.no_sync():
                F.mse_loss(model(x), y).backward()
        else:
            F.mse_loss(model(x), y).backward()
        optimizer.step()

    def record_hidden(key, model):
        if isinstance(model, DistributedDataParallel) and key != ("nosync",):
            stats = model.last_step_stats()
            if stats is not None:
                hidden_samples.setdefault(key, []).append(stats["hidden_fraction"])

    for key, times in step_in_turn(factories, step, comm.Barrier, steps, warmup, record_hidden).items():
        samples.setdefault(key, []).extend(times)
    optimizers.clear()


def init_torch_gloo(comm):
    """torch's default group over gloo for the comparison rows, through the backend's store on
    rank 0 (its port picked by the kernel and broadcast over ``comm``: no probed port that
    another process could take before the store binds it)."""
    import torch.distributed as dist

    from autograd_bridge.backend.rendezvous import rendezvous_store

    store = rendezvous_store(comm, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=comm.Get_rank(), world_size=comm.Get_size())
    return dist


def commlib_torch_group(dist):
    """A torch.distributed group over the "commlib" backend, or (None, reason)."""
    try:
        import autograd_bridge.backend as backend
    except ImportError as exc:
        return None, f"autograd_bridge.backend not importable ({exc})"
    try:
        getattr(backend, "register", lambda: None)()
        return dist.new_group(ranks=list(range(dist.get_world_size())), backend="commlib"), ""
    except Exception as exc:  # noqa: BLE001 - reported in the table, the rest still runs
        return None, f"{type(exc).__name__}: {exc}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddp.bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default per model)")
    parser.add_argument("--caps", type=float, nargs="+", default=[1, 5, 25, 100], help="bucket_cap_mb values")
    parser.add_argument("--first-cap", type=float, default=1, help="first_bucket_cap_mb")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="repetitions of the interleaved turns (samples pooled)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    parser.add_argument("--algorithm", default="auto", help="commlib allreduce algorithm for ours")
    parser.add_argument("--no-view", action="store_true", help="skip the gradient_as_bucket_view rows")
    parser.add_argument("--no-mpi-only", action="store_true", help="skip our DDP on a group without shared memory")
    parser.add_argument("--json", default=None, help="also write the rows to this file (rank 0; commlib.bench.record)")
    return parser


class Configurations:
    """The models the table compares, as factories (each builds a fresh replica of one base model)."""

    def __init__(self, base, args, group, torch_commlib):
        self.base, self.args, self.torch_commlib = base, args, torch_commlib
        self.views = (False,) if args.no_view else (False, True)
        # The same DDP on a group of the same ranks with shared memory off: what it was before.
        self.mpi_only = None if args.no_mpi_only else commlib.ProcessGroup(
            group.comm.Dup(), timeout=group.timeout, config=dataclasses.replace(group.config, shm=False),
            name="mpi-only")

    def replica(self):
        return copy.deepcopy(self.base)

    def ours(self, cap, as_view, process_group=None):
        args = self.args
        return lambda: DistributedDataParallel(self.replica(), process_group, bucket_cap_mb=cap,
                                               first_bucket_cap_mb=args.first_cap,
                                               gradient_as_bucket_view=as_view, algorithm=args.algorithm)

    def torch_ddp(self, cap, group=None):
        return lambda: torch.nn.parallel.DistributedDataParallel(self.replica(), bucket_cap_mb=cap,
                                                                 process_group=group)

    def of_cap(self, cap) -> dict:
        """Every configuration of one bucket cap, keyed as the step times are."""
        factories = {("local",): self.replica, ("nosync",): lambda: DistributedDataParallel(self.replica()),
                     ("gloo", cap): self.torch_ddp(cap)}
        if self.torch_commlib is not None:
            factories[("t/cl", cap)] = self.torch_ddp(cap, self.torch_commlib)
        for as_view in self.views:
            factories[("ours", cap, as_view)] = self.ours(cap, as_view)
            if self.mpi_only is not None:
                factories[("mpi", cap, as_view)] = self.ours(cap, as_view, self.mpi_only)
        return factories


def measure_memory(configs: Configurations, x, y) -> dict:
    """``{"local": (rss, info), (cap, view): (rss, info)}``: each configuration built alone (RSS
    growth means nothing when several models are alive) and stepped twice."""
    set_mmap_threshold(1 << 20)
    memory_and_layout(configs.replica, x, y)  # one-time allocations (kernels' workspaces) out of the RSS baseline
    layout: Dict[object, tuple] = {"local": memory_and_layout(configs.replica, x, y)}
    for cap in configs.args.caps:
        for as_view in configs.views:
            layout[(cap, as_view)] = memory_and_layout(configs.ours(cap, as_view), x, y, stats=True)
    set_mmap_threshold(32 << 20)
    return layout


def measure_steps(configs: Configurations, x, y, comm) -> dict:
    """``{key: (slowest rank's median step seconds, median hidden fraction or None)}``.

    Per bucket cap, every configuration alive at once and stepped in turn, one step each,
    ``--steps`` turns (after ``--warmup``), ``--rounds`` times: a slow spell of the shared
    machine lands on all of them alike, so their ratios hold even when the absolute times drift
    (measured blocks one configuration after another differed by 10-20%)."""
    args = configs.args
    samples: Dict[object, List[float]] = {}
    hidden_samples: Dict[object, List[float]] = {}
    for _ in range(args.rounds):
        for cap in args.caps:
            interleaved_steps(configs.of_cap(cap), x, y, args.steps, args.warmup, samples, hidden_samples, comm)
    return {key: (comm.allreduce(statistics.median(times), op=MPI.MAX),
                  statistics.median(hidden_samples[key]) if hidden_samples.get(key) else None)
            for key, times in samples.items()}


def _ms(result) -> float:
    return result[0] * 1e3


def _ms_if(result) -> Optional[float]:
    return None if result is None else _ms(result)


def make_rows(configs: Configurations, layout: dict, results: dict, grad_bytes: int, comm) -> List[dict]:
    """One row per bucket cap and view, keyed by the table's columns (and the model)."""
    def worst(value):
        return comm.allreduce(value, op=MPI.MAX)

    local_rss, local_info = layout["local"]
    nosync_ms, local_ms = _ms(results[("nosync",)]), _ms(results[("local",)])
    rows = []
    for cap in configs.args.caps:
        for as_view in configs.views:
            ours_ms, hidden = _ms(results[("ours", cap, as_view)]), results[("ours", cap, as_view)][1]
            ours_rss, info = layout[(cap, as_view)]
            bufs = sum(info["buckets"])
            gloo_ms, mpi_ms = _ms(results[("gloo", cap)]), _ms_if(results.get(("mpi", cap, as_view)))
            rows.append({
                "cap MB": cap, "view": as_view, "bkts": len(info["buckets"]), "ours ms": ours_ms, "mpi ms": mpi_ms,
                "gloo ms": gloo_ms, "t/cl ms": _ms_if(results.get(("t/cl", cap))), "nosync": nosync_ms,
                "local": local_ms, "ours/gloo": ours_ms / gloo_ms,
                "cost/mpi": (None if mpi_ms is None or mpi_ms <= nosync_ms
                             else (ours_ms - nosync_ms) / (mpi_ms - nosync_ms)),
                "hidden": hidden, "bufs/g": bufs / grad_bytes, "extra/g": (bufs - info["aliased"]) / grad_bytes,
                "rss+/g": worst(ours_rss - local_rss) / grad_bytes,
                "pss+/g": worst(info["pss"] - local_info["pss"]) / grad_bytes,
                "model": configs.args.model})
    return rows


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    group = commlib.init()
    comm = group.comm
    dist = init_torch_gloo(comm)
    torch_commlib, why_not = commlib_torch_group(dist)

    torch.manual_seed(0)
    base, make_batch, default_batch = build_model(args.model)
    torch.manual_seed(1 + group.rank)
    x, y = make_batch(args.batch or default_batch)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    configs = Configurations(base, args, group, torch_commlib)
    layout = measure_memory(configs, x, y)  # first: alone, before the step times keep models alive
    rows = make_rows(configs, layout, measure_steps(configs, x, y, comm), grad_bytes, comm)
    if group.rank == 0:
        print_table(rows, args, group.size, grad_bytes, why_not)
        if args.json:
            write_record(args.json, bench_record("ddp.bench", argv=argv, world_size=group.size,
                                                 columns=names(COLUMNS), rows=rows))
    dist.destroy_process_group()


def print_table(rows, args, size, grad_bytes, why_not) -> None:
    print(f"# ddp.bench model={args.model} P={size} per-rank batch={args.batch or 'default'} "
          f"params={grad_bytes / 4 / 1e6:.1f}M threads={args.threads} steps={args.steps} "
          f"rounds={args.rounds} algorithm={args.algorithm} first_cap={args.first_cap}MB")
    if why_not:
        print(f"# t/cl (torch DDP on commlib): n/a: {why_not}")
    print(header_line(COLUMNS))
    for row in rows:
        print(format_line(COLUMNS, row), flush=True)
