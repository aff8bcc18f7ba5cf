"""Helpers for rank scripts: fail on every rank when a check fails on any.

An assertion that fails on one rank only leaves the others waiting in the next collective;
``Checker`` collects failures locally and ``finish()`` gathers them across ranks (over MPI,
independently of commlib, so a broken commlib cannot hide its own failure), prints them on
rank 0 and exits non-zero everywhere.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

import numpy as np
from mpi4py import MPI

from tests.support import check_log
from tests.support.closed_form import DTYPES, OPS, closed_form, random_bytes, rank_values

__all__ = ["DTYPES", "OPS", "Checker", "expected_reduction", "random_bytes", "rank_values"]

# The inputs and their closed forms live in closed_form.py; these names stay importable from
# here, where rank scripts have always found them.
expected_reduction = closed_form


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
        # Every rank arrives first, waiting without spinning: MPICH busy-polls in blocking calls,
        # and a rank done early would take a core from those still checking (2 cores, 8 ranks).
        arrived = self.comm.Ibarrier()
        while not arrived.Test():
            time.sleep(0.002)
        all_failures = self.comm.allgather(self.failures)
        total_checks = self.comm.allreduce(self.checks)
        flat = [f for per_rank in all_failures for f in per_rank]
        # The verdict goes to stdout in one write: a job of several scripts (tests/support/job.py)
        # marks where each script's output ends on stdout, and mpiexec forwards a rank's stdout
        # and stderr separately, so a report on stderr, or in several writes, could land past
        # the next marker (seen: a failing script's report without its failure lines).
        if self.rank == 0:
            check_log.record(self.comm.Get_size(), total_checks, len(flat))
            if flat:
                print("\n".join([f"FAILED: {len(flat)} of {total_checks} checks",
                                 *("  " + failure for failure in flat[:50])]), flush=True)
            elif total_checks == 0:
                print("FAILED: no check ran", flush=True)
            else:
                print(f"OK: {total_checks} checks on {self.comm.Get_size()} ranks")
        sys.stdout.flush()
        sys.stderr.flush()
        if flat or total_checks == 0:
            sys.exit(1)


class LocalChecker(Checker):
    """A :class:`Checker` whose verdict is handed back rather than gathered over MPI (the ranks of
    a :class:`tests.support.socket_world.SocketWorld` report to pytest, which fails the test)."""

    def __init__(self, rank: int):
        self.comm = None
        self.rank = rank
        self.failures = []
        self.checks = 0

    def finish(self):
        """(checks run, failures) of this rank."""
        return self.checks, list(self.failures)
