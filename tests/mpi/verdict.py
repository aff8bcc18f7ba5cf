"""Helpers for rank scripts: fail on every rank when a check fails on any.

An assertion that fails on one rank only leaves the others waiting in the next collective;
``Checker`` collects failures locally and ``finish()`` gathers them across ranks (over MPI,
independently of commlib, so a broken commlib cannot hide its own failure), prints them on
rank 0 and exits non-zero everywhere.
"""

from __future__ import annotations

import sys
from typing import Optional

import numpy as np
from mpi4py import MPI

from commlib import ReduceOp

# What the collective checks sweep: every dtype the issue names, bfloat16 where ml_dtypes exists.
DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8"]
try:
    import ml_dtypes

    DTYPES.append(ml_dtypes.bfloat16)
except ImportError:
    pass
OPS = [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PROD]


def rank_values(rank: int, count: int, op: ReduceOp) -> np.ndarray:
    """Small integers, exact in every dtype when summed or multiplied over 8 ranks."""
    index = np.arange(count)
    if op is ReduceOp.PROD:
        return (index + rank) % 2 + 1
    return (index + 2 * rank) % 3 + 1


def random_bytes(seed: int, count: int, dtype) -> np.ndarray:
    """``count`` elements of ``dtype`` with random bytes (NaN payloads included), from ``seed``."""
    return np.random.default_rng(seed).integers(0, 256, count * dtype.itemsize, dtype=np.uint8).view(dtype)


def expected_reduction(size: int, count: int, op: ReduceOp) -> np.ndarray:
    """The closed form of an allreduce of :func:`rank_values` over ``size`` ranks (float64)."""
    stacked = np.stack([rank_values(r, count, op) for r in range(size)]).astype(np.float64)
    return {ReduceOp.SUM: stacked.sum(0), ReduceOp.AVG: stacked.mean(0), ReduceOp.MIN: stacked.min(0),
            ReduceOp.MAX: stacked.max(0), ReduceOp.PROD: stacked.prod(0)}[op]


class Checker:
    def __init__(self, comm=None):
        self.comm = comm or MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.failures = []
        self.checks = 0

    def check(self, condition, message) -> bool:
        self.checks += 1
        if not condition:
            self.failures.append(f"rank {self.rank}: {message() if callable(message) else message}")
        return bool(condition)

    def equal(self, actual, expected, what: str) -> bool:
        """Exact comparison (integers, bit-identical results); the message names the first bad index."""
        actual = np.asarray(actual)
        expected = np.asarray(expected)
        if actual.shape != expected.shape:
            return self.check(False, f"{what}: shape {actual.shape}, expected {expected.shape}")
        bad = np.flatnonzero(actual.reshape(-1) != expected.reshape(-1))
        return self.check(bad.size == 0, lambda: f"{what}: {bad.size} wrong; first at index {bad[0]}: "
                          f"got {actual.reshape(-1)[bad[0]]!r}, expected {expected.reshape(-1)[bad[0]]!r}")

    def close(self, actual, expected, what: str, rtol=1e-5, atol=1e-6) -> bool:
        actual = np.asarray(actual, dtype=np.float64)
        expected = np.asarray(expected, dtype=np.float64)
        if actual.shape != expected.shape:
            return self.check(False, f"{what}: shape {actual.shape}, expected {expected.shape}")
        ok = np.isclose(actual, expected, rtol=rtol, atol=atol)
        bad = np.flatnonzero(~ok.reshape(-1))
        return self.check(bad.size == 0, lambda: f"{what}: {bad.size} outside rtol={rtol} atol={atol}; "
                          f"first at index {bad[0]}: got {actual.reshape(-1)[bad[0]]!r}, "
                          f"expected {expected.reshape(-1)[bad[0]]!r}")

    def raises(self, exc_type, fn, what: str, match: Optional[str] = None):
        try:
            fn()
        except exc_type as exc:
            if match is not None and match not in str(exc):
                self.check(False, f"{what}: message {str(exc)!r} does not contain {match!r}")
            else:
                self.check(True, "")
            return exc
        except BaseException as exc:  # noqa: BLE001 - reported as a failure
            self.check(False, f"{what}: expected {exc_type.__name__}, got {type(exc).__name__}: {exc}")
            return None
        self.check(False, f"{what}: expected {exc_type.__name__}, nothing was raised")
        return None

    def finish(self) -> None:
        all_failures = self.comm.allgather(self.failures)
        total_checks = self.comm.allreduce(self.checks)
        flat = [f for per_rank in all_failures for f in per_rank]
        if self.rank == 0:
            if flat:
                print(f"FAILED: {len(flat)} of {total_checks} checks", file=sys.stderr)
                for failure in flat[:50]:
                    print("  " + failure, file=sys.stderr)
            else:
                print(f"OK: {total_checks} checks on {self.comm.Get_size()} ranks")
        sys.stdout.flush()
        sys.stderr.flush()
        if flat:
            sys.exit(1)
        if total_checks == 0:
            print("FAILED: no check ran", file=sys.stderr)
            sys.exit(1)
