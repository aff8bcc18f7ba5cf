"""Timing over ranks, shared by every benchmark CLI (``commlib.bench``, ``ddp.bench``,
``autograd_bridge.bench``; it knows no torch: the torch benchmarks hand it their models and step
functions).

The rule: every call starts from a barrier, the contenders of one row take turns (the first one
rotating), and a row reports the median over iterations of the slowest rank's time (a collective
is done when its last rank is). Taking turns makes a slow spell of a shared machine land on all
contenders alike, so their ratios hold while absolute times drift.
"""

from __future__ import annotations

import time
from typing import Dict, List

import numpy as np

__all__ = ["time_interleaved", "step_in_turn"]


def time_interleaved(comm, contenders, reset, iters: int, warmup: int) -> dict:
    """``{name: median seconds of the slowest rank}`` for ``contenders`` (``{name: run}``), interleaved.

    One iteration calls every contender once, the first one rotating from iteration to
    iteration (the same order on every rank: the calls are collective), so a slow spell of a
    shared machine lands on all of them alike and their ratios hold while absolute times drift.
    ``reset()`` runs before each call, outside the timing (fresh inputs); every call starts on a
    barrier of ``comm`` (an mpi4py communicator).
    """
    from mpi4py import MPI

    names = list(contenders)
    times = np.empty((len(names), iters))
    for iteration in range(warmup + iters):
        for offset in range(len(names)):
            index = (iteration + offset) % len(names)
            reset()
            comm.Barrier()
            start = time.perf_counter()
            contenders[names[index]]()
            elapsed = time.perf_counter() - start
            if iteration >= warmup:
                times[index, iteration - warmup] = elapsed
    comm.Allreduce(MPI.IN_PLACE, times, op=MPI.MAX)
    return {name: float(np.median(times[index])) for index, name in enumerate(names)}


def step_in_turn(factories, step, barrier, steps: int, warmup: int, on_sample=None) -> dict:
    """Build every model of ``factories``, then step them in turn: ``{key: [seconds per step]}``.

    Each of ``warmup + steps`` turns calls ``step(key, model)`` once per key, the first key
    rotating from turn to turn, each call after ``barrier()`` (so every rank times the same
    configuration at once); ``on_sample(key, model)`` runs after each timed step. All models are
    alive at once, so a slow spell of the machine lands on all of them alike (ratios between
    configurations hold while absolute step times drift 10-20%), and all are freed on return.
    """
    models = {key: factory() for key, factory in factories.items()}
    keys = list(models)
    samples: Dict[object, List[float]] = {key: [] for key in keys}
    for turn in range(warmup + steps):
        for offset in range(len(keys)):
            key = keys[(turn + offset) % len(keys)]
            barrier()
            start = time.perf_counter()
            step(key, models[key])
            elapsed = time.perf_counter() - start
            if turn >= warmup:
                samples[key].append(elapsed)
                if on_sample is not None:
                    on_sample(key, models[key])
    return samples
