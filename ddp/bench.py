"""mpiexec -n 2 python -m ddp.bench --model mlp --caps 1 5 25 100

Step time (forward + backward + SGD step, median over ``--steps`` after ``--warmup``, best of
``--rounds`` interleaved rounds) of one model
and per-rank batch, side by side in one run:

* ``ours``: ``ddp.DistributedDataParallel`` (``gradient_as_bucket_view`` False, and True as ``view``)
* ``gloo``: torch's own DDP over gloo (a TCP store on 127.0.0.1, port from rank 0 over mpi4py)
* ``t/cl``: torch's own DDP over the ``"commlib"`` torch.distributed backend
  (``autograd_bridge.backend``), n/a when that module cannot be imported or fails
* ``nosync``: our DDP inside ``no_sync()`` (the same work, no communication), and ``local``: the
  plain module, one process

``hidden``: fraction of our allreduce time that ran before backward ended (median of
``last_step_stats()``). Memory: ``bufs/g`` is the bytes of the bucket buffers our DDP allocates
over the model's gradient bytes; ``extra/g`` subtracts the gradients that *are* those buffers
(gradient_as_bucket_view), i.e. what DDP adds on top of the local model's parameters + grads.
``rss+/g``: measured, not computed: the peak growth of this process's resident set from just
before building the model to just after each backward (grads alive), DDP's minus the local
model's, over gradient bytes (glibc's mmap threshold is pinned so freed tensors leave the RSS). Step times are the
maximum over ranks of each rank's median.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import time

import torch
import torch.nn.functional as F

import commlib

from .distributed import DistributedDataParallel

__all__ = ["main"]


def build_model(name: str):
    if name == "mlp":  # 1024-4096-4096-1024: 25.2M parameters
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                    torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
        return model, (lambda batch: (torch.randn(batch, 1024), torch.randn(batch, 1024))), 128
    if name == "transformer":  # 3 layers, d512, ff2048, seq 128: 9.5M parameters
        layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        return model, (lambda batch: (torch.randn(batch, 128, 512), torch.randn(batch, 128, 512))), 4
    raise SystemExit(f"unknown --model {name!r}; expected mlp or transformer")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pin_mmap_threshold() -> None:
    """Make glibc return large freed blocks to the OS at once, so RSS deltas mean something.

    glibc raises its mmap threshold after big frees (up to 32 MiB) and then keeps freed
    tensors in the heap; fixing the threshold (``M_MMAP_THRESHOLD``) turns that off.
    """
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = 1 MiB
    except OSError:
        pass


def time_steps(make_model, x, y, steps: int, warmup: int, *, no_sync=False, stats=False):
    """Median step time (s), median hidden fraction, peak RSS growth (bytes) over building the model."""
    baseline = rss_bytes()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    times, hidden, rss = [], [], 0
    for step in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad()
        if no_sync:
            with model.no_sync():
                F.mse_loss(model(x), y).backward()
        else:
            F.mse_loss(model(x), y).backward()
        rss = max(rss, rss_bytes() - baseline)
        opt.step()
        elapsed = time.perf_counter() - start
        if step >= warmup:
            times.append(elapsed)
            if stats and model.last_step_stats() is not None:
                hidden.append(model.last_step_stats()["hidden_fraction"])
    info = {"buckets": model.bucket_sizes() if stats else None,
            "aliased": sum(p.numel() * p.element_size() for p in model.parameters()
                           if stats and model.gradient_as_bucket_view and p.grad is not None)}
    del model, opt
    return statistics.median(times), (statistics.median(hidden) if hidden else None), rss, info


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    parser.add_argument("--batch", type=int, default=None, help="per-rank batch (default per model)")
    parser.add_argument("--caps", type=float, nargs="+", default=[1, 5, 25, 100], help="bucket_cap_mb values")
    parser.add_argument("--first-cap", type=float, default=1, help="first_bucket_cap_mb")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions; best median kept")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads per rank")
    parser.add_argument("--algorithm", default="auto", help="commlib allreduce algorithm for ours")
    parser.add_argument("--no-view", action="store_true", help="skip the gradient_as_bucket_view rows")
    parser.add_argument("--json", default=None, help="also write the rows to this file (rank 0)")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    pin_mmap_threshold()
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

    def ours(cap, as_view):
        return lambda: DistributedDataParallel(replica(), bucket_cap_mb=cap, first_bucket_cap_mb=args.first_cap,
                                               gradient_as_bucket_view=as_view, algorithm=args.algorithm)

    def torch_ddp(cap, group=None):
        return lambda: torch.nn.parallel.DistributedDataParallel(replica(), bucket_cap_mb=cap, process_group=group)

    # Every configuration, measured once per round; rounds interleave them so that a slow spell
    # of the (shared) machine does not land on one configuration only. Best median over rounds.
    configs = {("local",): (replica, {}), ("nosync",): (lambda: DistributedDataParallel(replica()), {"no_sync": True})}
    views = (False,) if args.no_view else (False, True)
    for cap in args.caps:
        configs[("gloo", cap)] = (torch_ddp(cap), {})
        if torch_commlib is not None:
            configs[("t/cl", cap)] = (torch_ddp(cap, torch_commlib), {})
        for as_view in views:
            configs[("ours", cap, as_view)] = (ours(cap, as_view), {"stats": True})
    time_steps(replica, x, y, 1, 1)  # one-time allocations (kernels' workspaces) out of the RSS baseline
    results = {}
    for _ in range(args.rounds):
        for key, (factory, options) in configs.items():
            step_s, hidden, rss, info = time_steps(factory, x, y, args.steps, args.warmup, **options)
            step_s = worst(step_s)
            if key not in results or step_s < results[key][0]:
                results[key] = (step_s, hidden, rss, info)

    local_time, _, local_rss, _ = results[("local",)]
    nosync_time = results[("nosync",)][0]
    rows = []
    for cap in args.caps:
        for as_view in views:
            ours_time, hidden, ours_rss, info = results[("ours", cap, as_view)]
            bufs = sum(info["buckets"])
            tcl = results.get(("t/cl", cap))
            rows.append({
                "model": args.model, "P": size, "cap_mb": cap, "view": as_view, "buckets": len(info["buckets"]),
                "ours_ms": ours_time * 1e3, "gloo_ms": results[("gloo", cap)][0] * 1e3,
                "torch_commlib_ms": None if tcl is None else tcl[0] * 1e3,
                "nosync_ms": nosync_time * 1e3, "local_ms": local_time * 1e3,
                "hidden": hidden, "bufs_per_grad": bufs / grad_bytes,
                "extra_per_grad": (bufs - info["aliased"]) / grad_bytes,
                "rss_extra_per_grad": worst(ours_rss - local_rss) / grad_bytes,
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
    header = (f"{'cap MB':>6} {'view':>5} {'bkts':>4} {'ours ms':>8} {'gloo ms':>8} {'t/cl ms':>8} "
              f"{'nosync':>7} {'local':>7} {'ours/gloo':>9} {'hidden':>6} {'bufs/g':>6} {'extra/g':>7} {'rss+/g':>6}")
    print(header)
    for row in rows:
        tcl = "n/a" if row["torch_commlib_ms"] is None else f"{row['torch_commlib_ms']:.1f}"
        hidden = "n/a" if row["hidden"] is None else f"{row['hidden']:.2f}"
        print(f"{row['cap_mb']:>6g} {str(row['view']):>5} {row['buckets']:>4} {row['ours_ms']:>8.1f} "
              f"{row['gloo_ms']:>8.1f} {tcl:>8} {row['nosync_ms']:>7.1f} {row['local_ms']:>7.1f} "
              f"{row['ours_ms'] / row['gloo_ms']:>9.2f} {hidden:>6} {row['bufs_per_grad']:>6.2f} "
              f"{row['extra_per_grad']:>7.2f} {row['rss_extra_per_grad']:>6.2f}")


if __name__ == "__main__":
    main()
