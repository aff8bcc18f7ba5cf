"""Short sleeps on Linux: a waiting thread's timer slack, lowered while the wait sleeps.

Linux may end a sleep up to the thread's *timer slack* late (50 us by default, so that wake-ups
batch). Our waits yield the core for their first 100 us, then sleep 10-200 us at a time, and
the slack was most of each sleep: ``time.sleep(20e-6)`` took 94 us here (median of 2000),
45 us with a 1 us slack. A wait that goes to sleep a moment before its peer finishes therefore
woke one slack late, which at P=2 was a tenth of a 16 MiB shared-memory allreduce (measured in
the same runs: 0.96-1.02 ms with the default slack, 0.91-0.93 ms with 1 us).

So a wait sleeps through a :class:`FineSleeper`: it lowers the slack of its own thread at the
first sleep and puts back what the thread had when the wait ends (the thread may be the
user's). Elsewhere than Linux, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from typing import Callable, Optional

__all__ = ["FineSleeper", "fine_timer_slack", "restore_timer_slack", "FINE_SLACK_NS"]

_PR_SET_TIMERSLACK = 29
_PR_GET_TIMERSLACK = 30
FINE_SLACK_NS = 1000

_prctl: Optional[Callable[..., int]] = None
_loaded = False


def _load() -> Optional[Callable[..., int]]:
    global _prctl, _loaded
    if not _loaded:
        _loaded = True
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
                prctl = libc.prctl
                prctl.restype = ctypes.c_int
                prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
                _prctl = prctl
            except (OSError, AttributeError):
                _prctl = None
    return _prctl


def fine_timer_slack() -> int:
    """Set this thread's timer slack to ``FINE_SLACK_NS``; the slack it had (0: nothing changed)."""
    prctl = _load()
    if prctl is None:
        return 0
    previous = prctl(_PR_GET_TIMERSLACK, 0, 0, 0, 0)
    if previous <= FINE_SLACK_NS or prctl(_PR_SET_TIMERSLACK, FINE_SLACK_NS, 0, 0, 0) != 0:
        return 0
    return previous


def restore_timer_slack(previous: int) -> None:
    """Put back what :func:`fine_timer_slack` returned (nothing for 0)."""
    if previous > 0 and _prctl is not None:
        _prctl(_PR_SET_TIMERSLACK, previous, 0, 0, 0)


class FineSleeper:
    """``sleep(seconds)`` with this thread's timer slack fine from the first sleep until
    ``restore()`` (call it in a ``finally``; nothing to restore if it never slept)."""

    __slots__ = ("_previous",)

    def __init__(self) -> None:
        self._previous = -1  # not lowered yet

    def sleep(self, seconds: float) -> None:
        if self._previous < 0:
            self._previous = fine_timer_slack()
        time.sleep(seconds)

    def restore(self) -> None:
        restore_timer_slack(self._previous)
        self._previous = -1
