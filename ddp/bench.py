"""mpiexec -n 2 python -m ddp.bench --model mlp --caps 1 5 25 100

(With ``--sync ddp powersgd localsgd partial ...``: step time and bytes of PowerSGD and local SGD
against DDP instead, see :mod:`ddp.bench_sync`.)

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
import json
import os
import socket
import statistics
from typing import Dict, List

import torch
import torch.nn.functional as F

import commlib
from commlib.benchtools import step_in_turn

from .distributed import DistributedDataParallel

__all__ = ["main"]


def build_model(name: str):
    if name == "mlp":  # 1024-4096-4096-1024: 25.2M parameters
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
            torch.nn.Linear(4096, 1024))
        return model, (lambda batch: (torch.randn(batch, 1024), torch.randn(batch, 1024))), 128
    if name == "transformer":  # 3 layers, d512, ff2048, seq 128: 9.5M parameters
        layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        return model, (lambda batch: (torch.randn(batch, 128, 512), torch.randn(batch, 128, 512))), 4
    raise SystemExit(f"unknown --model {name!r}; expected mlp or transformer")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pss_bytes() -> int:
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def set_mmap_threshold(threshold_bytes: int) -> None:
    """Fix glibc's mmap threshold (and its trim threshold at twice that), as ``mallopt`` does.

    For the memory pass, 1 MiB: glibc raises its threshold after big frees (up to 32 MiB) and
    then keeps freed tensors in the heap, so RSS deltas would mean nothing. For the step times,
    32 MiB, where glibc's own adaptation ends up: with 1 MiB every tensor costs an mmap and fresh
    zeroed pages, which made a transformer step 468 ms instead of 332 ms (its communication 110
    ms instead of 45-49) in an A/B run.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, threshold_bytes)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 2 * threshold_bytes)  # M_TRIM_THRESHOLD
    except OSError:
        pass


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

    The turns are ``commlib.benchtools.step_in_turn``'s (a barrier before each step, the first
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
    import torch.distributed as dist

    port = None
    if comm.Get_rank() == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    port = comm.bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
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


def main(argv=None) -> None:
    import sys

    if "--sync" in (sys.argv[1:] if argv is None else argv):
        # Communication-efficient methods against DDP: a table of its own (ddp/bench_sync.py).
        from .bench_sync import main as sync_main

        return sync_main(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
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
    parser.add_argument("--json", default=None, help="also write the rows to this file (rank 0)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    group = commlib.init()
    comm = group.comm
    rank, size = group.rank, group.size
    dist = init_torch_gloo(comm)
    torch_commlib, why_not = commlib_torch_group(dist)

    torch.manual_seed(0)
    base, make_batch, default_batch = build_model(args.model)
    torch.manual_seed(1 + rank)
    x, y = make_batch(args.batch or default_batch)
    grad_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    worst = lambda value: comm.allreduce(value, op=__import__("mpi4py").MPI.MAX)  # noqa: E731

    def replica():
        return copy.deepcopy(base)

    # The same DDP on a group of the same ranks with shared memory off: what it was before.
    mpi_only = None if args.no_mpi_only else commlib.ProcessGroup(
        comm.Dup(), timeout=group.timeout, config=dataclasses.replace(group.config, shm=False), name="mpi-only")

    def ours(cap, as_view, process_group=None):
        return lambda: DistributedDataParallel(replica(), process_group, bucket_cap_mb=cap,
                                               first_bucket_cap_mb=args.first_cap,
                                               gradient_as_bucket_view=as_view, algorithm=args.algorithm)

    def torch_ddp(cap, group=None):
        return lambda: torch.nn.parallel.DistributedDataParallel(replica(), bucket_cap_mb=cap, process_group=group)

    views = (False,) if args.no_view else (False, True)
    # Memory and bucket layout first: each configuration built alone (RSS growth means nothing
    # when several models are alive) and stepped twice.
    set_mmap_threshold(1 << 20)
    memory_and_layout(replica, x, y)  # one-time allocations (kernels' workspaces) out of the RSS baseline
    local_rss, local_info = memory_and_layout(replica, x, y)
    layout = {(cap, as_view): memory_and_layout(ours(cap, as_view), x, y, stats=True)
              for cap in args.caps for as_view in views}

    set_mmap_threshold(32 << 20)

    # Step times: per bucket cap, every configuration alive at once and stepped in turn, one
    # step each, ``--steps`` turns (after ``--warmup``), ``--rounds`` times: a slow spell of the
    # shared machine lands on all of them alike, so their ratios hold even when the absolute
    # times drift (measured blocks one configuration after another differed by 10-20%).
    samples: Dict[object, List[float]] = {}
    hidden_samples: Dict[object, List[float]] = {}
    for _ in range(args.rounds):
        for cap in args.caps:
            factories = {("local",): replica, ("nosync",): lambda: DistributedDataParallel(replica()),
                         ("gloo", cap): torch_ddp(cap)}
            if torch_commlib is not None:
                factories[("t/cl", cap)] = torch_ddp(cap, torch_commlib)
            for as_view in views:
                factories[("ours", cap, as_view)] = ours(cap, as_view)
                if mpi_only is not None:
                    factories[("mpi", cap, as_view)] = ours(cap, as_view, mpi_only)
            interleaved_steps(factories, x, y, args.steps, args.warmup, samples, hidden_samples, comm)

    def step_time(key):
        return worst(statistics.median(samples[key]))

    results = {key: (step_time(key),
                     statistics.median(hidden_samples[key]) if hidden_samples.get(key) else None)
               for key in samples}
    local_time = results[("local",)][0]
    nosync_time = results[("nosync",)][0]
    rows = []
    for cap in args.caps:
        for as_view in views:
            ours_time, hidden = results[("ours", cap, as_view)]
            ours_rss, info = layout[(cap, as_view)]
            bufs = sum(info["buckets"])
            tcl = results.get(("t/cl", cap))
            mpi = results.get(("mpi", cap, as_view))
            rows.append({
                "model": args.model, "P": size, "cap_mb": cap, "view": as_view, "buckets": len(info["buckets"]),
                "ours_ms": ours_time * 1e3, "gloo_ms": results[("gloo", cap)][0] * 1e3,
                "torch_commlib_ms": None if tcl is None else tcl[0] * 1e3,
                "nosync_ms": nosync_time * 1e3, "local_ms": local_time * 1e3,
                "hidden": hidden, "bufs_per_grad": bufs / grad_bytes,
                "extra_per_grad": (bufs - info["aliased"]) / grad_bytes,
                "rss_extra_per_grad": worst(ours_rss - local_rss) / grad_bytes,
                "pss_extra_per_grad": worst(info["pss"] - local_info["pss"]) / grad_bytes,
                "mpi_only_ms": None if mpi is None else mpi[0] * 1e3,
            })
    if rank == 0:
        print_table(rows, args, size, grad_bytes, why_not)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(rows, out, indent=1)
    dist.destroy_process_group()


def print_table(rows, args, size, grad_bytes, why_not) -> None:
    print(f"# ddp.bench model={args.model} P={size} per-rank batch={args.batch or 'default'} "
          f"params={grad_bytes / 4 / 1e6:.1f}M threads={args.threads} steps={args.steps} "
          f"rounds={args.rounds} algorithm={args.algorithm} first_cap={args.first_cap}MB")
    if why_not:
        print(f"# t/cl (torch DDP on commlib): n/a: {why_not}")
    header = (f"{'cap MB':>6} {'view':>5} {'bkts':>4} {'ours ms':>8} {'mpi ms':>8} {'gloo ms':>8} {'t/cl ms':>8} "
              f"{'nosync':>7} {'local':>7} {'ours/gloo':>9} {'cost/mpi':>8} {'hidden':>6} {'bufs/g':>6} "
              f"{'extra/g':>7} {'rss+/g':>6} {'pss+/g':>6}")
    print(header)
    for row in rows:
        tcl = "n/a" if row["torch_commlib_ms"] is None else f"{row['torch_commlib_ms']:.1f}"
        hidden = "n/a" if row["hidden"] is None else f"{row['hidden']:.2f}"
        mpi = "n/a" if row["mpi_only_ms"] is None else f"{row['mpi_only_ms']:.1f}"
        cost = ("n/a" if row["mpi_only_ms"] is None or row["mpi_only_ms"] <= row["nosync_ms"] else
                f"{(row['ours_ms'] - row['nosync_ms']) / (row['mpi_only_ms'] - row['nosync_ms']):.2f}")
        print(f"{row['cap_mb']:>6g} {row['view']!s:>5} {row['buckets']:>4} {row['ours_ms']:>8.1f} {mpi:>8} "
              f"{row['gloo_ms']:>8.1f} {tcl:>8} {row['nosync_ms']:>7.1f} {row['local_ms']:>7.1f} "
              f"{row['ours_ms'] / row['gloo_ms']:>9.2f} {cost:>8} {hidden:>6} {row['bufs_per_grad']:>6.2f} "
              f"{row['extra_per_grad']:>7.2f} {row['rss_extra_per_grad']:>6.2f} {row['pss_extra_per_grad']:>6.2f}")


if __name__ == "__main__":
    main()
