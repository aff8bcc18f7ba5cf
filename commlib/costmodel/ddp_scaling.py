"""Predicting a DDP training step at more ranks: a measured trace, replayed with modelled allreduces.

Input: a trace of our DDP (``mpi_examples/train_digits.py --trace``, see ``ddp/tracing.py``): per
step, ``forward``, ``backward`` (autograd plus DDP's finalize, which waits for the last bucket),
``finalize``, ``optimizer`` spans and one ``bucket_ready`` instant per bucket with its bytes.
From rank 0's steps (the first, warm-up, dropped) it takes the median of: forward, backward's
compute (backward minus finalize), optimizer, each bucket's ready time from the start of
backward, and finalize's own work (what remains of it once the wait for communication is
taken out).

Replay (the policy of our reducer): buckets are allreduced one after another on the comm thread,
bucket ``i`` starting at ``max(ready_i, end_{i-1})`` and taking the model's time for the size
with the algorithm ``auto`` would pick (the model's cheapest) at ``H`` hosts x ``K`` ranks;
``step = forward + max(backward compute, end_last) + finalize work + optimizer``. Weak scaling
(each rank keeps its batch): efficiency = step at one rank / step at ``P`` ranks.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Dict, List, NamedTuple, Sequence

from commlib.errors import InvalidUsageError

__all__ = ["StepProfile", "profile_from_trace", "Scaling", "predict_scaling"]


class StepProfile(NamedTuple):
    forward: float          # seconds
    backward: float         # autograd's compute, without DDP's final wait
    optimizer: float
    finalize_work: float    # finalize beyond waiting for communication
    ready: List[float]      # each bucket's ready time, seconds after backward started
    nbytes: List[int]       # each bucket's size
    steps: int              # how many steps the medians are over


def profile_from_trace(path) -> StepProfile:
    try:
        trace = json.loads(Path(path).read_text())
        events = trace["traceEvents"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InvalidUsageError(f"trace {path}: not a Chrome trace of ddp.tracing ({error})") from None
    by_step: Dict[int, Dict[str, list]] = {}
    for event in events:
        if event.get("pid") != 0 or "step" not in event.get("args", {}):
            continue
        by_step.setdefault(event["args"]["step"], {}).setdefault(event["name"], []).append(event)
    steps = [step for step in sorted(by_step)
             if all(name in by_step[step] for name in ("forward", "backward", "bucket_ready"))]
    if len(steps) > 2:
        steps = steps[1:]  # the first step warms up (allocations, first-touch, bucket rebuild)
    if not steps:
        raise InvalidUsageError(f"trace {path}: no step with forward, backward and bucket_ready events "
                                f"on rank 0 (record one with train_digits.py --trace)")
    buckets = max(len(by_step[s]["bucket_ready"]) for s in steps)
    steps = [s for s in steps if len(by_step[s]["bucket_ready"]) == buckets]
    forward, backward, optimizer, finalize_work = [], [], [], []
    ready: List[List[float]] = [[] for _ in range(buckets)]
    nbytes: List[int] = [0] * buckets
    for step in steps:
        names = by_step[step]
        back = names["backward"][0]
        final = names.get("finalize", [{"ts": back["ts"] + back["dur"], "dur": 0.0}])[0]
        autograd = max(0.0, back["dur"] - final["dur"])
        forward.append(names["forward"][0]["dur"])
        backward.append(autograd)
        optimizer.append(names.get("optimizer", [{"dur": 0.0}])[0]["dur"])
        comm_end = max((e["ts"] + e["dur"] for e in names.get("allreduce", [])), default=final["ts"])
        finalize_work.append(max(0.0, final["dur"] - max(0.0, comm_end - final["ts"])))
        for index, event in enumerate(sorted(names["bucket_ready"], key=lambda e: e["args"].get("bucket", 0))):
            ready[index].append(max(0.0, event["ts"] - back["ts"]))
            nbytes[index] = int(event["args"].get("bytes", 0))
    us = 1e-6
    return StepProfile(statistics.median(forward) * us, statistics.median(backward) * us,
                       statistics.median(optimizer) * us, statistics.median(finalize_work) * us,
                       [statistics.median(r) * us for r in ready], nbytes, len(steps))


class Scaling(NamedTuple):
    hosts: int
    per_host: int
    step: float           # seconds
    comm: float           # sum of the buckets' allreduce times
    exposed: float        # communication not hidden behind backward
    efficiency: float
    algorithms: List[str]


def predict_scaling(model, profile: StepProfile, hosts: Sequence[int], per_host: int,
                    available=None) -> List[Scaling]:
    local = profile.forward + profile.backward + profile.finalize_work + profile.optimizer
    rows = []
    for host_count in hosts:
        comm_end, comm_total, chosen = 0.0, 0.0, []
        if host_count * per_host > 1:
            for ready, size in zip(profile.ready, profile.nbytes):
                name, _ = model.choose(size, host_count, per_host, available)
                seconds = model.predict(size, host_count, per_host)[name].total
                comm_end = max(ready, comm_end) + seconds
                comm_total += seconds
                chosen.append(name)
        exposed = max(0.0, comm_end - profile.backward)
        step = local + exposed
        rows.append(Scaling(host_count, per_host, step, comm_total, exposed, local / step, chosen))
    return rows
