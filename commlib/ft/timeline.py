"""A fault-tolerant run's timeline, from its replicas' events: what ran when, and a picture.

    python -m commlib.ft.timeline r0.json r1.json r2.json --png timeline.png

Each file is one replica's :attr:`commlib.ft.Manager.events`, written by
:meth:`commlib.ft.Manager.save_events` (a replica that was killed leaves the file of its last
save, or none: the survivors' events tell its story too). It prints, in wall-clock order:

* the quorums: when each epoch formed, its members, and why the one before it ended;
* the catch-ups: who took how many bytes from a live peer, and how long the transfer took;
* the failures each replica saw (a failed allreduce, vote or entry, a discarded step, a lost
  coordinator);
* the committed steps: how many replicas ran each one.

``--png`` draws the same on one time axis: replicas per committed step above, and one row per
replica below (commits, discarded steps, quorum entries, catch-up transfers as bars, failures).
Times are seconds from the first event; the replicas' clocks are the machines' own (one
machine's, or hosts kept in sync by NTP).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Sequence

from commlib.units import format_bytes

__all__ = ["load_events", "quorums", "transfers", "failures", "members_per_step", "draw", "main"]

FAILURE_KINDS = ("allreduce-failed", "vote-failed", "enter-failed", "abort", "outcome-unknown", "coordinator-lost",
                 "group-aborted")


def load_events(paths: Sequence[str]) -> List[dict]:
    """Every replica's events, merged in time order."""
    events: List[dict] = []
    for path in paths:
        with open(path) as handle:
            saved = json.load(handle)
        events.extend(saved["events"])
    return sorted(events, key=lambda event: event["t"])


def quorums(events: Sequence[dict]) -> List[dict]:
    """One entry per epoch, at its first member's entry: ``t``, ``epoch``, ``members``, ``reason``."""
    seen: Dict[int, dict] = {}
    for event in events:
        if event["kind"] == "quorum" and event["epoch"] not in seen:
            seen[event["epoch"]] = {"t": event["t"], "epoch": event["epoch"], "members": list(event["members"]),
                                    "reason": event.get("reason", "")}
    return sorted(seen.values(), key=lambda quorum: quorum["t"])


def transfers(events: Sequence[dict]) -> List[dict]:
    """The catch-ups that moved state: ``t`` (loaded), ``replica`` (the one that caught up),
    ``bytes``, ``seconds`` (the transfer) and ``epoch``: those two are on the replica's entry
    into that quorum, its next ``quorum`` event (the state is loaded while it enters)."""
    found = []
    for index, event in enumerate(events):
        if event["kind"] != "caught-up":
            continue
        entry = next((other for other in events[index:] if other["kind"] == "quorum"
                      and other["replica"] == event["replica"]), None)
        found.append({"t": event["t"], "replica": event["replica"], "bytes": event["bytes"],
                      "seconds": entry["transfer_s"] if entry is not None else 0.0,
                      "epoch": entry["epoch"] if entry is not None else None})
    return found


def failures(events: Sequence[dict]) -> List[dict]:
    return [event for event in events if event["kind"] in FAILURE_KINDS]


def members_per_step(events: Sequence[dict]) -> Dict[int, List[str]]:
    """Committed step -> its members (every member logs the same commit)."""
    steps: Dict[int, List[str]] = {}
    for event in events:
        if event["kind"] == "commit":
            steps.setdefault(event["step"], list(event["members"]))
    return dict(sorted(steps.items()))


def _report(events: Sequence[dict], out=sys.stdout) -> None:
    start = events[0]["t"] if events else 0.0
    print("# quorums (time s, epoch, members, why the previous one ended)", file=out)
    for quorum in quorums(events):
        print(f"{quorum['t'] - start:8.3f}  e{quorum['epoch']:<4} {','.join(quorum['members']):<24} "
              f"{quorum['reason']}", file=out)
    print("# catch-ups from a live peer (time s, replica, bytes, transfer s)", file=out)
    for transfer in transfers(events):
        print(f"{transfer['t'] - start:8.3f}  {transfer['replica']:<8} {transfer['bytes']:>12} "
              f"{transfer['seconds']:8.3f}", file=out)
    print("# failures seen (time s, replica, kind, detail)", file=out)
    for event in failures(events):
        detail = event.get("error", "") or (f"step {event['step']}" if "step" in event else "")
        print(f"{event['t'] - start:8.3f}  {event['replica']:<8} {event['kind']:<18} {detail[:100]}", file=out)
    steps = members_per_step(events)
    print(f"# committed steps: {len(steps)}; replicas per step: "
          f"{' '.join(str(len(members)) for members in steps.values())}", file=out)


def draw(events: Sequence[dict], path: str) -> None:
    """The picture (see the module docstring); needs matplotlib (the ``examples`` extra)."""
    try:
        import matplotlib
    except ImportError as missing:
        raise SystemExit("commlib.ft.timeline --png needs matplotlib: pip install matplotlib") from missing
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = events[0]["t"] if events else 0.0
    replicas = sorted({event["replica"] for event in events})
    row = {replica: index for index, replica in enumerate(replicas)}
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 2.5 + 0.45 * len(replicas)),
                                         gridspec_kw={"height_ratios": [1, max(1, len(replicas) // 2)]})
    commits: Dict[int, tuple] = {}
    for event in events:
        if event["kind"] == "commit":
            commits.setdefault(event["step"], (event["t"] - start, len(event["members"])))
    if commits:
        times, counts = zip(*commits.values())
        top.step(times, counts, where="post", color="black")
        top.plot(times, counts, "k.", markersize=4)
        top.set_ylim(0, max(counts) + 1)
    for quorum in quorums(events):
        top.axvline(quorum["t"] - start, color="tab:blue", linewidth=0.8, alpha=0.6)
    top.set_ylabel("replicas\nper step")
    top.set_title("fault-tolerant run: committed steps, quorums (blue lines), catch-ups (green), failures (red)")
    for transfer in transfers(events):
        bottom.barh(row[transfer["replica"]], transfer["seconds"], left=transfer["t"] - start - transfer["seconds"],
                    height=0.5, color="tab:green", alpha=0.7)
        bottom.annotate(format_bytes(transfer["bytes"]), (transfer["t"] - start, row[transfer["replica"]]),
                        xytext=(3, 6), textcoords="offset points", fontsize=7, color="tab:green")
    styles = {"commit": ("|", "black", 8), "quorum": ("^", "tab:blue", 6), "abort": ("x", "tab:red", 7)}
    for kind, (marker, color, size) in styles.items():
        points = [(event["t"] - start, row[event["replica"]]) for event in events if event["kind"] == kind]
        if points:
            xs, ys = zip(*points)
            bottom.plot(xs, ys, marker, color=color, markersize=size, linestyle="none", label=kind)
    failed = [(event["t"] - start, row[event["replica"]]) for event in failures(events) if event["kind"] != "abort"]
    if failed:
        xs, ys = zip(*failed)
        bottom.plot(xs, ys, "o", color="tab:red", markersize=5, linestyle="none", label="failure seen")
    for replica in replicas:  # where each replica's record ends (a killed one: its death, about)
        last = max(event["t"] for event in events if event["replica"] == replica) - start
        bottom.plot([last], [row[replica]], "s", color="0.4", markersize=4)
    bottom.set_yticks(range(len(replicas)), replicas)
    bottom.set_ylim(-0.7, len(replicas) - 0.3)
    bottom.set_xlabel("seconds from the first event")
    bottom.legend(loc="upper left", fontsize=7, ncol=5)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.ft.timeline", description=__doc__.splitlines()[0])
    parser.add_argument("events", nargs="+", help="the replicas' event files (Manager.save_events)")
    parser.add_argument("--png", help="draw the timeline into this file")
    args = parser.parse_args(argv)
    events = load_events(args.events)
    if not events:
        print("commlib.ft.timeline: no events in the given files", file=sys.stderr)
        return 1
    _report(events)
    if args.png:
        draw(events, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
