"""Read a trace written by ``ddp.tracing``: overlap figures per step and rank, and a picture.

    python -m ddp.timeline trace.json --png overlap.png [--step N]

For each rank and step it measures what the paper is about: how much of the time spent in
gradient allreduces ran while autograd was still computing (hidden) rather than while the rank
had nothing else to do (exposed). "Busy" is forward, backward and optimizer, minus DDP's
finalize: finalize runs inside ``loss.backward()`` but only waits for the last buckets, so
communication during it is exposed, not hidden. The slowest rank of a step is the one with the
most busy time: the others wait for it in their allreduces.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

__all__ = ["load_trace", "step_stats", "StepStats", "union", "intersect", "subtract", "total",
           "draw_step", "main"]

Interval = Tuple[float, float]
COMPUTE_SPANS = ("forward", "backward", "optimizer")


# -- interval arithmetic on sorted, disjoint lists --------------------------------------------
def union(intervals) -> List[Interval]:
    merged: List[List[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> List[Interval]:
    out = []
    for start, end in a:
        for cut_start, cut_end in b:
            if cut_end <= start or cut_start >= end:
                continue
            if cut_start > start:
                out.append((start, cut_start))
            start = max(start, cut_end)
            if start >= end:
                break
        if start < end:
            out.append((start, end))
    return out


def total(intervals: Sequence[Interval]) -> float:
    return sum(end - start for start, end in intervals)


# -- per-step figures ------------------------------------------------------------------------
@dataclasses.dataclass
class StepStats:
    rank: int
    step: int
    start_us: float
    end_us: float
    forward_us: float
    backward_us: float
    finalize_us: float
    optimizer_us: float
    busy_us: float
    comm_us: float
    hidden_us: float
    buckets: int

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_us / self.comm_us if self.comm_us > 0 else 0.0

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


def load_trace(path) -> dict:
    with open(path) as handle:
        trace = json.load(handle)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: expected a JSON object with a 'traceEvents' list (Trace Event Format)")
    return trace


def events_by_rank_step(trace: dict) -> Dict[Tuple[int, int], List[dict]]:
    grouped = defaultdict(list)
    for event in trace["traceEvents"]:
        if event.get("ph") in ("X", "i") and "step" in event.get("args", {}):
            grouped[(event["pid"], event["args"]["step"])].append(event)
    return grouped


def step_stats(trace: dict) -> List[StepStats]:
    """One :class:`StepStats` per (rank, step) that has compute events, sorted by step then rank."""
    out = []
    for (rank, step), events in sorted(events_by_rank_step(trace).items(), key=lambda kv: (kv[0][1], kv[0][0])):
        spans = defaultdict(list)
        for event in events:
            if event["ph"] == "X" and event.get("cat") != "steps":
                spans[event["name"]].append((event["ts"], event["ts"] + event["dur"]))
        if not any(spans[name] for name in COMPUTE_SPANS):
            continue
        finalize = union(spans["finalize"])
        busy = subtract(union([span for name in COMPUTE_SPANS for span in spans[name]]), finalize)
        comm = union(spans["allreduce"])
        everything = [iv for name, ivs in spans.items() for iv in ivs]
        out.append(StepStats(
            rank=rank, step=step,
            start_us=min(a for a, _ in everything), end_us=max(b for _, b in everything),
            forward_us=total(union(spans["forward"])), backward_us=total(union(spans["backward"])),
            finalize_us=total(finalize), optimizer_us=total(union(spans["optimizer"])),
            busy_us=total(busy), comm_us=total(comm), hidden_us=total(intersect(comm, busy)),
            buckets=len({e["args"].get("bucket") for e in events if e["name"] == "allreduce"}),
        ))
    return out


_MEAN_FIELDS = ("forward_us", "backward_us", "finalize_us", "optimizer_us", "comm_us", "hidden_us")


def summarize(stats: List[StepStats], max_steps: int = 12, out=sys.stdout) -> None:
    """Print per-rank means, then per step the slowest rank (the first ``max_steps`` steps)."""
    if not stats:
        print("no steps in the trace (was tracer.set_step called?)", file=out)
        return
    by_rank = defaultdict(list)
    by_step = defaultdict(list)
    for s in stats:
        by_rank[s.rank].append(s)
        by_step[s.step].append(s)
    # The first step pays for warm-up (allocations, autograd graph building): leave it out of means.
    first = min(by_step)
    print(f"{'rank':>4} {'steps':>5} {'forward':>9} {'backward':>9} {'finalize':>9} {'optimizer':>9} "
          f"{'comm':>9} {'hidden':>9} {'hidden %':>8}   (ms, mean per step, step {first} left out)", file=out)
    for rank, rows in sorted(by_rank.items()):
        rows = [r for r in rows if r.step != first] or rows
        mean = {field: statistics.fmean(getattr(r, field) for r in rows) / 1e3 for field in _MEAN_FIELDS}
        comm, hidden = sum(r.comm_us for r in rows), sum(r.hidden_us for r in rows)
        print(f"{rank:>4} {len(rows):>5} {mean['forward_us']:>9.3f} {mean['backward_us']:>9.3f} "
              f"{mean['finalize_us']:>9.3f} {mean['optimizer_us']:>9.3f} {mean['comm_us']:>9.3f} "
              f"{mean['hidden_us']:>9.3f} {100 * hidden / comm if comm else 0:>7.1f}%", file=out)
    counted = [s for s in stats if s.step != first] or stats
    comm, hidden = sum(s.comm_us for s in counted), sum(s.hidden_us for s in counted)
    print(f"communication hidden behind computation: {100 * hidden / comm if comm else 0:.1f}% "
          f"of {comm / 1e3:.3f} ms allreduce time (all ranks and steps)", file=out)
    slowest_count: Dict[int, int] = defaultdict(int)
    print(f"{'step':>5} {'slowest':>7} {'busy ms':>8} {'others wait ms':>14} {'step ms':>8}", file=out)
    for index, (step, rows) in enumerate(sorted(by_step.items())):
        slowest = max(rows, key=lambda r: r.busy_us)
        slowest_count[slowest.rank] += 1
        others = [r for r in rows if r is not slowest]
        wait = statistics.fmean(r.finalize_us for r in others) / 1e3 if others else 0.0
        step_ms = (max(r.end_us for r in rows) - min(r.start_us for r in rows)) / 1e3
        if index < max_steps:
            print(f"{step:>5} {slowest.rank:>7} {slowest.busy_us / 1e3:>8.3f} {wait:>14.3f} {step_ms:>8.3f}", file=out)
    if len(by_step) > max_steps:
        print(f"  ... {len(by_step) - max_steps} more steps", file=out)
    print("slowest rank: " + ", ".join(f"rank {r} in {n}/{len(by_step)} steps"
                                       for r, n in sorted(slowest_count.items())), file=out)


def typical_step(stats: List[StepStats]) -> int:
    """The step of median length, warm-up step excluded: a fair one to draw."""
    steps = sorted({s.step for s in stats})
    candidates = steps[1:] or steps
    length = {step: max(s.duration_us for s in stats if s.step == step) for step in candidates}
    ordered = sorted(candidates, key=lambda step: length[step])
    return ordered[len(ordered) // 2]


# -- the picture -----------------------------------------------------------------------------
def draw_step(trace: dict, step: int, png_path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grouped = {rank: events for (rank, s), events in events_by_rank_step(trace).items() if s == step}
    if not grouped:
        raise ValueError(f"step {step} is not in the trace")
    ranks = sorted(grouped)
    origin = min(e["ts"] for events in grouped.values() for e in events)
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "optimizer": "#55a868", "finalize": "#c44e52"}
    tab20 = plt.get_cmap("tab20")
    bucket_colors = [tab20(i) for i in range(tab20.N)]
    hidden = {s.rank: s.hidden_fraction for s in step_stats(trace) if s.step == step}
    fig, ax = plt.subplots(figsize=(12, 1.6 + 1.1 * len(ranks)))
    yticks, ylabels = [], []
    for row, rank in enumerate(ranks):
        # Rank 0 on top; each rank a compute lane above its communication lane.
        comm_y = (len(ranks) - 1 - row) * 2.4
        compute_y = comm_y + 1.1
        yticks += [compute_y + 0.4, comm_y + 0.4]
        ylabels += [f"rank {rank} compute", f"comm ({100 * hidden.get(rank, 0):.0f}% hidden)"]
        # One communication thread runs a rank's allreduces in launch order: a bucket launched
        # while the previous one still runs waits for it. Its bar starts when it is served; its
        # tick in the compute lane shows when it was ready.
        served_from = 0.0
        for event in sorted(grouped[rank], key=lambda e: (e["name"] == "finalize", e["ts"])):
            start = (event["ts"] - origin) / 1e3
            name = event["name"]
            if event["ph"] == "X" and name in colors:
                ax.broken_barh([(start, event["dur"] / 1e3)], (compute_y, 0.8), color=colors[name],
                               alpha=0.55 if name == "finalize" else 0.9, hatch="//" if name == "finalize" else None)
            elif event["ph"] == "X" and name == "allreduce":
                bucket, end = event["args"].get("bucket", 0), start + event["dur"] / 1e3
                color = bucket_colors[int(bucket) % 20]
                served = min(max(start, served_from), end)
                served_from = end
                ax.broken_barh([(served, end - served)], (comm_y, 0.8), color=color, edgecolor="black", linewidth=0.5)
                kib = event["args"].get("bytes", 0) / 1024
                ax.text((served + end) / 2, comm_y + 0.4, f"b{bucket} {kib:.0f}K\n{event['args'].get('algorithm', '')}",
                        ha="center", va="center", fontsize=6)
            elif event["ph"] == "i" and name == "bucket_ready":
                ax.vlines(start, compute_y, compute_y + 0.8, color="black", linewidth=0.8)
                ax.text(start, compute_y + 0.85, f"b{event['args'].get('bucket', '?')}", fontsize=6, ha="center")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=7, ncol=4,
              frameon=False)
    ax.set_yticks(yticks)
    ax.set_yticklabels(ylabels, fontsize=8)
    ax.set_xlabel("ms since the step started (rank 0's clock)")
    ax.set_title(f"step {step}: compute lanes (bars), bucket ready (ticks), allreduce per bucket (comm lanes)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="trace JSON written by ddp.tracing.Tracer.write (--trace of train_digits.py)")
    parser.add_argument("--png", help="draw one step per rank into this PNG file")
    parser.add_argument("--step", type=int, help="the step to draw (default: the median-length step)")
    parser.add_argument("--max-steps", type=int, default=12, help="steps listed one per line (default 12)")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace)
    stats = step_stats(trace)
    summarize(stats, args.max_steps)
    if args.png:
        if not stats:
            print("nothing to draw", file=sys.stderr)
            return 1
        step = typical_step(stats) if args.step is None else args.step
        draw_step(trace, step, args.png)
        print(f"wrote {args.png} (step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
