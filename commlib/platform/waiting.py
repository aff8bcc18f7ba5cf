"""Waiting for MPI requests with a deadline, without starving the other threads or ranks.

MPICH makes progress only inside MPI calls and busy-polls inside blocking ones, so a rank that
sits in ``MPI_Wait`` holds a core and can never give up. We poll ``Testall`` instead, and every
few polls call ``sched_yield``: when ranks share a core (more ranks than cores, or a rank's own
compute thread beside its communication thread) a spinning waiter otherwise holds the core the
peer needs to make the very progress it waits for (measured at 4 ranks on 2 cores: an 8-byte
``MPI_Iallreduce`` took 2.7 ms with a plain spin, 0.11 ms with the yield). A wait that lasts
more than a few milliseconds turns into short sleeps, and the deadline turns a missing peer into
an error. When the job's ranks outnumber this machine's cores (:mod:`commlib.platform.machine`) the
yield comes after every poll. During the sleeps a ``give_up`` check (a peer whose process exited, read from the
progress board) may end a wait that can never succeed long before its deadline.
"""

from __future__ import annotations

import functools
import os
import time

from mpi4py import MPI

from commlib.platform.backoff import next_sleep
from commlib.platform.machine import polls_per_yield
from commlib.platform.timer_slack import FineSleeper

__all__ = ["wait_all", "SLEEP_AFTER_SECONDS"]

SLEEP_AFTER_SECONDS = 5e-3
MAX_SLEEP_SECONDS = 5e-4
GIVE_UP_CHECK_SECONDS = 0.02


def wait_all(requests, deadline: float, give_up=None, statuses=None) -> bool:
    """Complete ``requests``; return False if ``deadline`` (``time.monotonic``) passed first, or
    if ``give_up()`` (checked every few milliseconds once the wait sleeps) said it never will.

    ``statuses``: a list of ``MPI.Status``, one per request, filled on completion (receives
    with ``ANY_SOURCE`` learn the sender from it).
    """
    # The poll as one bound call: the loop below is the whole cost of a wait when ranks share
    # cores (4 ranks on 2: an 8-byte allgather polls a few dozen times), and each of its Python
    # operations is paid by the peers waiting for this rank's turn on a core.
    if statuses is not None:
        testall = functools.partial(MPI.Request.Testall, requests, statuses)
    elif len(requests) == 1:  # one request (a native collective): Test is a third of Testall's cost
        testall = requests[0].Test
    else:
        testall = functools.partial(MPI.Request.Testall, requests)
    polls = range(polls_per_yield())
    for _ in polls:
        if testall():
            return True
    sched_yield, monotonic = os.sched_yield, time.monotonic
    start = monotonic()
    next_give_up_check = start
    sleep = 1e-5
    sleeper = FineSleeper()
    try:
        while True:
            sched_yield()
            now = monotonic()
            if now >= deadline:
                return bool(testall())
            if now - start > SLEEP_AFTER_SECONDS:
                if give_up is not None and now >= next_give_up_check:
                    if give_up():
                        return bool(testall())
                    next_give_up_check = now + GIVE_UP_CHECK_SECONDS
                sleeper.sleep(sleep)
                sleep = next_sleep(sleep, now - start, MAX_SLEEP_SECONDS)
            for _ in polls:
                if testall():
                    return True
    finally:
        sleeper.restore()
