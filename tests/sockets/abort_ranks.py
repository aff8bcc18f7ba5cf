"""What the ranks of the group-abort tests run (tests/sockets/test_socket_abort.py): a ProcessGroup
over the rank's socket transport; each function returns (error type, message, seconds)."""

from __future__ import annotations

import threading
import time

import numpy as np

from commlib.errors import CommError
from tests.support.socket_world import process_group


def _outcome(call, started):
    try:
        call()
    except CommError as error:
        return type(error).__name__, str(error), time.monotonic() - started
    return "ok", "", time.monotonic() - started


def setup(state):
    group = process_group(state, "abortable")
    group.barrier()
    return group.rank


def allreduce_aborted_by(state, aborter: int, absent: int, after: float):
    """Every rank but ``absent`` (a peer cut off: it sends nothing) enters an allreduce that
    cannot finish; ``aborter`` aborts its group from another thread ``after`` seconds in.
    ``absent`` sleeps, then calls the allreduce too, late."""
    group = process_group(state, "abortable")
    buf = np.ones(1 << 16, np.float32)
    if group.rank == absent:
        time.sleep(after + 1.0)
    started = time.monotonic()  # before the timer starts: the abort is never earlier than `after`
    if group.rank == aborter:
        threading.Timer(after, group.abort, args=("the coordinator lost a member",)).start()
    return _outcome(lambda: group.allreduce(buf), started)


def next_collective(state):
    group = process_group(state, "abortable")
    started = time.monotonic()
    return _outcome(lambda: group.barrier(), started)


def recv_aborted(state, after: float):
    """Rank 0 waits for a message nobody sends; another thread aborts the group."""
    group = process_group(state, "abortable")
    if group.rank != 0:
        return "ok", "", 0.0
    started = time.monotonic()
    threading.Timer(after, group.abort, args=("no sender",)).start()
    return _outcome(lambda: group.recv(np.empty(4, np.float32), 1), started)
