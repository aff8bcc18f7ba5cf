"""How long a polling wait sleeps next: doubling up to the caller's cap, then, once the wait has
lasted, growing with it.

Every waiter that polls (MPI requests in :mod:`commlib.platform.waiting`, the MPI point-to-point
progress thread, the shared-memory transport's counters) sleeps in short steps with a small cap
(0.2-0.5 ms), so that a peer that is a little late is seen at once. A wait for a peer that is
seconds late (a rank still starting, a timeout being waited out, a joiner's state on the wire)
would keep polling at that rate: a rank waiting 5 s for an 8-byte allreduce used 1.1 s of CPU
in MPI's wait (0.6 s in the shared-memory transport's), taken from the ranks that do work, and
about 0.15 s with the sleeps below. Past the cap, the sleep grows to ``LONG_WAIT_FRACTION`` of
the time already waited (at most ``LONG_WAIT_MAX_SLEEP_SECONDS``): a wait sees its peer at most
1% later than it otherwise would. Deadlines and liveness checks are read at every wake, so they are late by
at most one sleep.
"""

from __future__ import annotations

__all__ = ["next_sleep", "LONG_WAIT_FRACTION", "LONG_WAIT_MAX_SLEEP_SECONDS"]

LONG_WAIT_FRACTION = 0.01
LONG_WAIT_MAX_SLEEP_SECONDS = 5e-3


def next_sleep(sleep: float, waited: float, cap: float) -> float:
    """The sleep after ``sleep`` of a wait that has lasted ``waited`` seconds, with ``cap`` the
    waiter's own limit for short waits."""
    return min(sleep * 2, max(cap, min(waited * LONG_WAIT_FRACTION, LONG_WAIT_MAX_SLEEP_SECONDS)))
