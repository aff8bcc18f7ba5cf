"""What the benchmark CLIs share: sizes in and out, timing over ranks, dtypes, nccl-tests' bus bandwidth.

Used by ``python -m commlib.bench``, ``python -m autograd_bridge.bench`` and ``python -m ddp.bench``
(it knows no torch: the torch benchmarks hand it their models and step functions). Timing rule: every
call starts from a barrier, the contenders of one size take turns, and a row reports the median
over iterations of the slowest rank's time (the collective is done when its last rank is).
"""

from __future__ import annotations

import argparse
import time
from typing import Dict, List

import numpy as np

from .transports.interface import format_bytes

__all__ = ["parse_size", "format_size", "resolve_dtype", "time_interleaved", "step_in_turn", "bus_factor",
           "BUS_FACTORS"]

format_size = format_bytes  # "8 B", "64 KiB", "4 MiB": one formatter for every table and message

_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"8"``, ``"64K"``, ``"4MiB"`` -> bytes."""
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGIB")
    suffix = stripped[len(digits):]
    if not digits.isdigit() or suffix not in _SUFFIXES:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected an integer with an optional K/M/G suffix")
    return int(digits) * _SUFFIXES[suffix]


def resolve_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


# nccl-tests' bus bandwidth: the per-link traffic of a bandwidth-optimal algorithm, as a factor of
# algbw = size / time (PERFORMANCE.md of nccl-tests).
BUS_FACTORS = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "gather": lambda p: (p - 1) / p,
    "scatter": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
    "barrier": lambda p: 0.0,  # no payload: nothing crosses a link but the synchronisation itself
}


def bus_factor(collective: str, world_size: int) -> float:
    return BUS_FACTORS[collective](world_size) if world_size > 1 else 1.0


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
