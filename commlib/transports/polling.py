"""Waiting for MPI requests with a deadline, without starving the other threads.

MPICH makes progress only inside MPI calls and busy-polls inside blocking ones, so a rank that
sits in ``MPI_Wait`` holds a core and can never give up. We poll ``Testall`` instead: a short
spin keeps small-message latency at a few microseconds, then the loop yields the GIL and finally
sleeps in growing steps, and it checks the deadline so a missing peer becomes an error.
"""

from __future__ import annotations

import time

from mpi4py import MPI

__all__ = ["wait_all", "SPIN_SECONDS"]

SPIN_SECONDS = 2e-4
YIELD_SECONDS = 5e-3
MAX_SLEEP_SECONDS = 1e-3


def wait_all(requests, deadline: float) -> bool:
    """Complete ``requests``; return False if ``deadline`` (``time.monotonic``) passed first."""
    testall = MPI.Request.Testall
    if testall(requests):
        return True
    start = time.monotonic()
    spins = 0
    sleep = 1e-5
    while True:
        if testall(requests):
            return True
        spins += 1
        if spins & 63:
            continue
        now = time.monotonic()
        if now >= deadline:
            return testall(requests)
        waited = now - start
        if waited < SPIN_SECONDS:
            continue
        if waited < YIELD_SECONDS:
            time.sleep(0)
        else:
            time.sleep(sleep)
            sleep = min(sleep * 2, MAX_SLEEP_SECONDS)
