"""torch.distributed over "commlib" vs over gloo, in one job: allreduce latency and torch DDP step.

    flock /tmp/commlib-cpu.lock mpiexec -n 2 python -m autograd_bridge.bench [--json out.json]

Part 1: ``dist.all_reduce(t)`` (float32, sum, sync) from 8 B to 1 MiB, on the default "commlib"
group and on a gloo group of the same ranks. A sample is the mean of ``iters`` back-to-back calls
after a barrier; the table shows the median of the samples, the ratio gloo/commlib, busbw
(algbw * 2(P-1)/P) and #wrong (a check call with rank-derived values before timing).

Part 2: torch's own DistributedDataParallel on a 25M-parameter MLP (1024-4096-4096-1024, batch
128 per rank, torch.set_num_threads(1), SGD), the same model and data on both backends, steps
taking turns between them (``commlib.bench.timing.step_in_turn``, shared with ``ddp.bench``); the
median step time (forward + backward + optimizer) of rank 0.

(``--json`` keeps the layout tests/mpi/test_bench.py reads; ``autograd_bridge.bench.stack`` writes
the shared ``commlib-bench/1`` format.)
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Dict

import torch
import torch.distributed as dist

from autograd_bridge.bench.allreduce_ddp import MLP_WIDTHS, SIZES, allreduce_latency, ddp_step_times, make_mlp
from commlib.units import format_bytes as format_size


def main(argv=None) -> None:
    import autograd_bridge

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this file (rank 0)")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="timed DDP steps per backend")
    parser.add_argument("--no-ddp", action="store_true", help="latency table only")
    parser.add_argument("--widths", type=lambda text: tuple(int(w) for w in text.split(",")), default=MLP_WIDTHS,
                        help="the DDP MLP's layer widths (default %(default)s)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    autograd_bridge.init_process_group()
    gloo = dist.new_group(backend="gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    groups = {"commlib": None, "gloo": gloo}
    results: Dict[str, Any] = {"world_size": size, "torch": torch.__version__, "allreduce": [], "ddp": {}}

    def say(text=""):
        if rank == 0:
            print(text, flush=True)

    say(f"# dist.all_reduce float32 sum, sync; P={size}; median of {args.samples} samples; torch {torch.__version__}")
    say(f"{'size':>9} {'count':>7} {'commlib us':>11} {'gloo us':>9} {'gloo/commlib':>12} "
        f"{'commlib busbw GB/s':>18} {'gloo busbw GB/s':>15} {'#wrong':>6}")
    for nbytes in SIZES:
        row: Dict[str, float] = {"bytes": nbytes, "count": max(1, nbytes // 4)}
        for name, group in groups.items():
            seconds, wrong = allreduce_latency(group, nbytes, args.samples)
            row[f"{name}_us"] = seconds * 1e6
            row[f"{name}_wrong"] = wrong
            row[f"{name}_busbw"] = nbytes / seconds * 2 * (size - 1) / size / 1e9 if size > 1 else 0.0
        row["ratio"] = row["gloo_us"] / row["commlib_us"]
        results["allreduce"].append(row)
        say(f"{format_size(nbytes):>9} {row['count']:>7} {row['commlib_us']:>11.1f} {row['gloo_us']:>9.1f} "
            f"{row['ratio']:>12.1f} {row['commlib_busbw']:>18.3f} {row['gloo_busbw']:>15.3f} "
            f"{row['commlib_wrong'] + row['gloo_wrong']:>6}")

    if not args.no_ddp:
        params = sum(p.numel() for p in make_mlp(args.widths).parameters())
        say()
        say(f"# torch DDP step (fwd+bwd+SGD), MLP {'-'.join(map(str, args.widths))} ({params / 1e6:.1f}M params), "
            f"batch 128/rank, 1 thread, P={size}, {args.steps} steps each after 2 warm-up, taking turns")
        times = ddp_step_times(groups, steps=args.steps, widths=args.widths)
        medians = {name: statistics.median(values) for name, values in times.items()}
        say(f"{'backend':>8} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
        for name, values in times.items():
            say(f"{name:>8} {medians[name] * 1e3:>10.1f} {min(values) * 1e3:>8.1f} {max(values) * 1e3:>8.1f}")
            results["ddp"][name] = {"median_s": medians[name], "steps_s": values}
        say(f"gloo/commlib step time: {medians['gloo'] / medians['commlib']:.2f}")

    if args.json and rank == 0:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
