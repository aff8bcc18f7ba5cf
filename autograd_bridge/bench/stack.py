"""torch's modern stack over "commlib" vs over gloo, in one job: FSDP2, DTensor, sparse allreduce.

    flock /tmp/commlib-cpu.lock mpiexec -n 2 python -m autograd_bridge.bench.stack [--json out.json]

1. **FSDP2 step**: the 25M-parameter MLP of the DDP benchmark (1024-4096-4096-1024), ``fully_shard``
   on every Linear and at the root, on a DeviceMesh of each backend; batch 128 per rank, SGD,
   one thread; steps taking turns between the backends (``step_in_turn``). ``collectives ms``:
   the wall time rank 0 spends inside FSDP2's ``dist.all_gather_single`` and
   ``dist.reduce_scatter_single`` calls in a step (both synchronous on CPU: FSDP2 streams
   nothing there), timed around those two functions.
2. **DTensor redistribute** Shard(0) -> Replicate of a float32 vector (8 KiB and more), and, to
   show where its time goes, the all-gather under it: torch's functional collective (what
   DTensor calls, waited) and ``dist.all_gather_into_tensor``. Microseconds per call, median of
   ``--samples`` samples of back-to-back calls, backends alternating sample by sample.
   ``floor us``: the same call on a "commlib" group whose all-gather only copies the rank's own
   block (no communication): what torch's own code around the collective costs, which no
   backend can go below; ``gloo/floor`` is then the most any backend could gain over gloo.
3. **Sparse allreduce** of an embedding gradient: a 100k x 64 float32 table, 1% of its rows (each
   rank its own), as a sparse COO tensor; milliseconds per ``dist.all_reduce``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import functools
import statistics
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autograd_bridge.bench.allreduce_ddp import MLP_WIDTHS, make_mlp
from autograd_bridge.bench.table import Table
from commlib.bench.record import bench_record, write_record
from commlib.bench.timing import step_in_turn
from commlib.units import format_bytes

__all__ = ["fsdp_step_times", "interleaved_us", "main"]

BACKENDS = ("commlib", "gloo")


class _CollectiveClock:
    """Adds up the time spent in FSDP2's all-gather and reduce-scatter calls (it calls them as
    ``dist.all_gather_single`` / ``dist.reduce_scatter_single``)."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0
        self._originals = {}

    def __enter__(self):
        for name in ("all_gather_single", "reduce_scatter_single"):
            original = self._originals[name] = getattr(dist, name)
            setattr(dist, name, self._timed(original))
        return self

    def _timed(self, original):
        def call(*args, **kwargs):
            start = time.perf_counter()
            work = original(*args, **kwargs)
            if work is not None:  # an async call: its wait is part of it
                work.wait()
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return work

        return call

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)


def fsdp_step_times(meshes: Dict[str, object], steps: int, warmup: int = 2, batch: int = 128, widths=MLP_WIDTHS):
    """{backend: ([seconds per step], [collective seconds per step], collectives per step)}."""
    from torch.distributed.fsdp import fully_shard

    data = torch.Generator().manual_seed(dist.get_rank())
    x, target = torch.randn(batch, widths[0], generator=data), torch.randn(batch, widths[-1], generator=data)
    optimizers: Dict[str, torch.optim.Optimizer] = {}
    clocks = {name: _CollectiveClock() for name in meshes}
    spent: Dict[str, List[float]] = {name: [] for name in meshes}

    def build(mesh):
        model = make_mlp(widths)
        for layer in model.children():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def step(name, model):
        optimizer = optimizers.setdefault(name, torch.optim.SGD(model.parameters(), lr=1e-3))
        clock = clocks[name]
        before = clock.seconds
        with clock:
            torch.nn.functional.mse_loss(model(x), target).backward()
            optimizer.step()
            optimizer.zero_grad()
        spent[name].append(clock.seconds - before)

    factories = {name: (lambda mesh=mesh: build(mesh)) for name, mesh in meshes.items()}
    times = step_in_turn(factories, step, dist.barrier, steps, warmup)
    turns = steps + warmup
    return {name: (times[name], spent[name][warmup:], clocks[name].calls // turns) for name in meshes}


def interleaved_us(calls: Dict[str, Callable[[], object]], samples: int, iters: int) -> Dict[str, float]:
    """Median microseconds per call of each entry, sampling the entries in turn (after a warm-up)."""
    for fn in calls.values():
        for _ in range(5):
            fn()
    times: Dict[str, List[float]] = {name: [] for name in calls}
    for _ in range(samples):
        for name, fn in calls.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            times[name].append((time.perf_counter() - start) / iters)
    return {name: statistics.median(values) * 1e6 for name, values in times.items()}


def _fsdp_table(meshes, args, say) -> Table:
    params = sum(p.numel() for p in make_mlp(args.widths).parameters())
    table = Table(f"FSDP2 step (fwd+bwd+SGD), fully_shard per Linear + root, MLP {'-'.join(map(str, args.widths))} "
                  f"({params / 1e6:.1f}M params), batch 128/rank, 1 thread, P={dist.get_world_size()}, "
                  f"{args.steps} steps each after 2 warm-up, taking turns",
                  ("backend", "median ms", "min ms", "max ms", "collectives ms", "calls", "x gloo step",
                   "x gloo collectives"), say)
    results = fsdp_step_times(meshes, args.steps, widths=args.widths)
    medians = {name: (statistics.median(steps), statistics.median(spent))
               for name, (steps, spent, _) in results.items()}
    for name, (steps, spent, calls) in results.items():
        table.add({"backend": name, "median ms": medians[name][0] * 1e3, "min ms": min(steps) * 1e3,
                   "max ms": max(steps) * 1e3, "collectives ms": medians[name][1] * 1e3, "calls": calls,
                   "x gloo step": medians[name][0] / medians["gloo"][0],
                   "x gloo collectives": medians[name][1] / medians["gloo"][1], "steps_s": steps,
                   "collectives_s": spent})
    return table


def _floor_mesh(size: int):
    """A 1-D mesh over a new "commlib" group whose all-gathers copy the rank's own block only.

    The stand-ins are attributes of that one group object (torch finds a Python group's methods
    on the object, from Python and through its C++ trampoline alike), so the real meshes are
    untouched. Its results are wrong by design: it is timed, never checked."""
    from torch.distributed.device_mesh import DeviceMesh

    from autograd_bridge.backend.work import done_work

    group = dist.new_group(backend="commlib")
    rank, finished = dist.get_rank(group), done_work()

    def own_block_only(output, input, opts=None):
        output.view(size, -1)[rank].copy_(input.view(-1))
        return finished

    group.all_gather_single = group._allgather_base = own_block_only
    return DeviceMesh.from_group(group, "cpu")


def _dtensor_table(meshes, args, say) -> Table:
    import torch.distributed._functional_collectives as funcol

    size = dist.get_world_size()
    table = Table(f"DTensor redistribute Shard(0) -> Replicate, float32, P={size}, us per call, median of "
                  f"{args.samples} samples; floor: the call without communication",
                  ("size", "what", "commlib us", "gloo us", "gloo/commlib", "floor us", "gloo/floor"), say)
    meshes = dict(meshes, floor=_floor_mesh(size))
    for nbytes in args.sizes:
        whole = torch.randn(nbytes // 4)
        shards = {name: distribute_tensor(whole, mesh, [Shard(0)]) for name, mesh in meshes.items()
                  if name != "floor"}
        shards["floor"] = DTensor.from_local(shards["commlib"].to_local().clone(), meshes["floor"], [Shard(0)])
        local = whole[:nbytes // 4 // size].clone()
        out = torch.empty(local.numel() * size)
        iters = args.iters or max(5, min(200, (1 << 22) // nbytes))
        kinds: Dict[str, Callable[..., object]] = {
            "redistribute": lambda name, shards=shards: shards[name].redistribute(meshes[name], [Replicate()]),
            "funcol all_gather": lambda name, local=local: funcol.wait_tensor(
                funcol.all_gather_tensor(local, 0, meshes[name].get_group())),
            "all_gather_into_tensor": lambda name, out=out, local=local: dist.all_gather_into_tensor(
                out, local, group=meshes[name].get_group()),
        }
        for what, fn in kinds.items():
            us = interleaved_us({name: functools.partial(fn, name) for name in meshes}, args.samples, iters)
            table.add({"size": format_bytes(nbytes), "bytes": nbytes, "what": what, "commlib us": us["commlib"],
                       "gloo us": us["gloo"], "gloo/commlib": us["gloo"] / us["commlib"], "floor us": us["floor"],
                       "gloo/floor": us["gloo"] / us["floor"]})
    return table


def _sparse_table(gloo, args, say) -> Table:
    rows, width = args.sparse_rows, 64
    touched = rows // 100
    rank = dist.get_rank()
    table = Table(f"sparse allreduce (COO) of an embedding gradient, {rows} x {width} float32, {touched} rows "
                  f"per rank, P={dist.get_world_size()}, ms per call, median of {args.samples} samples",
                  ("backend", "median ms", "gloo/commlib"), say)
    picked = torch.randperm(rows, generator=torch.Generator().manual_seed(rank))[:touched]
    values = torch.randn(touched, width, generator=torch.Generator().manual_seed(rank))

    def allreduce(group):
        dist.all_reduce(torch.sparse_coo_tensor(picked[None], values, (rows, width)), group=group)

    ms = {name: us / 1e3 for name, us in interleaved_us(
        {"commlib": lambda: allreduce(None), "gloo": lambda: allreduce(gloo)}, args.samples, args.iters or 3).items()}
    for name in BACKENDS:
        table.add({"backend": name, "median ms": ms[name], "gloo/commlib": ms["gloo"] / ms[name]})
    return table


def main(argv=None) -> None:
    import autograd_bridge

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the tables to this file (rank 0), format commlib-bench/1")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="timed FSDP2 steps per backend")
    parser.add_argument("--sizes", type=lambda text: [int(s) for s in text.split(",")], default=[8192, 65536, 1 << 20],
                        help="DTensor sizes in bytes, comma-separated")
    parser.add_argument("--widths", type=lambda text: [int(w) for w in text.split(",")], default=list(MLP_WIDTHS),
                        help="the FSDP2 MLP's layer widths, comma-separated")
    parser.add_argument("--sparse-rows", type=int, default=100_000, help="rows of the sparse embedding table")
    parser.add_argument("--iters", type=int, default=0, help="calls per sample (default: by size)")
    parser.add_argument("--only", default="fsdp,dtensor,sparse")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    autograd_bridge.init_process_group()
    size, rank = dist.get_world_size(), dist.get_rank()
    meshes = {"commlib": init_device_mesh("cpu", (size,)),
              "gloo": init_device_mesh("cpu", (size,), backend_override={0: "gloo"})}

    def say(text=""):
        if rank == 0:
            print(text, flush=True)

    tables = {}
    parts = args.only.split(",")
    if "fsdp" in parts:
        tables["fsdp"] = _fsdp_table(meshes, args, say).record()
        say()
    if "dtensor" in parts:
        tables["dtensor"] = _dtensor_table(meshes, args, say).record()
        say()
    if "sparse" in parts:
        tables["sparse"] = _sparse_table(meshes["gloo"].get_group(), args, say).record()
    if args.json and rank == 0:  # one file per table: PATH-fsdp.json, PATH-dtensor.json, ...
        stem = args.json[:-5] if args.json.endswith(".json") else args.json
        for name, table in tables.items():
            write_record(f"{stem}-{name}.json", bench_record(
                "autograd_bridge.bench.stack", argv=sys.argv[1:], world_size=size, columns=table["columns"],
                rows=table["rows"], notes=f"the {name} table"))
    # Every rank done, and nothing left that holds a collective's tensors: gloo's worker threads
    # must not free Python objects while the interpreter shuts down (torch then aborts, rarely:
    # "terminate called without an active exception"), as in mpi_examples/fsdp_transformer.py.
    dist.barrier()
    del meshes
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
