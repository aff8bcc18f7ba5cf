"""What the ranks of a :class:`tests.support.socket_world.SocketWorld` run for the point-to-point
channel over sockets (:class:`commlib.group.socket_p2p.SocketPointToPoint`)."""

from __future__ import annotations

import time

import numpy as np

from commlib.group.socket_p2p import SocketPointToPoint
from tests.support import p2p_checks
from tests.support.verdict import LocalChecker


def open_channel(state, timeout=60.0, options=None):
    """Collective: the channel of the world's ranks (kept on the rank's state); ``options``:
    SocketPointToPoint's keywords."""
    state.p2p = SocketPointToPoint(state.transport, timeout=timeout, name="world", **(options or {}))
    return state.p2p.tag_limit


def sync(state):
    """A barrier outside the channel: the socket transport's own."""
    state.seq = getattr(state, "seq", 0) + 1
    state.transport.context.begin("barrier", state.seq, "native", 0, 120.0)
    state.transport.native_barrier()


def run_checks(state, names):
    """The named checks of :mod:`tests.support.p2p_checks`: (checks run, failures) of this rank."""
    check = LocalChecker(state.rank)
    for name in names:
        getattr(p2p_checks, name)(check, state.p2p, lambda: sync(state))
    return check.finish()


def receive_from_until_error(state, peer, timeout):
    """Wait (irecv, then a blocking recv) for ``peer``, which never sends: for each, (error type,
    text, time.monotonic() when it ended)."""
    pending = state.p2p.irecv(np.empty(4), peer, tag=5, timeout=timeout)
    outcomes = []
    for wait in (lambda: state.p2p.recv(np.empty(1 << 20), peer, tag=6, timeout=timeout), pending.wait):
        try:
            wait()
            outcomes.append(("returned", "", time.monotonic()))
        except Exception as error:  # noqa: BLE001 - the test looks at it
            outcomes.append((type(error).__name__, str(error), time.monotonic()))
    return outcomes


def close_channel(state):
    state.p2p.close()


def flood(state, to, count, nbytes, first_tag):
    """``count`` messages of ``nbytes`` to ``to``, tags from ``first_tag``, posted at once (isend)."""
    state.flood = [state.p2p.isend(np.full(nbytes, tag % 251, np.uint8), to, tag=tag, timeout=60.0)
                   for tag in range(first_tag, first_tag + count)]


def flood_done(state):
    for work in state.flood:
        work.wait()


def held(state):
    """(held messages, held bytes, the bound, peers whose connection is parked) on this rank."""
    engine = state.p2p.engine
    with engine.lock:
        return len(engine.held), engine.held_bytes, engine.max_held_bytes, [
            link.peer for link in engine.links if link is not None and link.parked]


def take(state, source, nbytes, tags, timeout=30.0):
    """Receive one message per tag, in that order: per tag, None (exact) or what went wrong."""
    outcomes = []
    for tag in tags:
        buf = np.zeros(nbytes, np.uint8)
        try:
            state.p2p.recv(buf, source, tag=tag, timeout=timeout)
            outcomes.append(None if np.all(buf == tag % 251) else f"tag {tag}: wrong bytes")
        except Exception as error:  # noqa: BLE001 - the test looks at it
            outcomes.append(f"{type(error).__name__}: {error}")
    return outcomes


def send_that_gives_up(state, to, nbytes, tag, timeout):
    """A send nobody receives in time, then a small message with the same tag: the error's text."""
    try:
        state.p2p.send(np.ones(nbytes, np.uint8), to, tag=tag, timeout=timeout)
        error = "sent"
    except Exception as caught:  # noqa: BLE001 - the test looks at it
        error = f"{type(caught).__name__}: {caught}"
    state.p2p.send(np.full(8, 7, np.uint8), to, tag=tag)
    return error


def receive_small(state, source, tag):
    buf = np.zeros(8, np.uint8)
    state.p2p.recv(buf, source, tag=tag, timeout=30.0)
    return buf.tolist()


def threads_ring(state, threads, rounds):
    """``threads`` threads each exchange ``rounds`` messages around the ring on tags of their own."""
    import threading

    p2p, rank, size = state.p2p, state.rank, state.size
    right, left = (rank + 1) % size, (rank - 1) % size
    problems = []

    def run(index):
        for round_number in range(rounds):
            tag = index * 1000 + round_number
            count = 1 + (round_number * 37 + index) % 20000  # eager and rendezvous sizes mixed
            got = np.empty(count, np.int32)
            work = p2p.irecv(got, left, tag=tag)
            p2p.send(np.arange(count, dtype=np.int32) + left * 0 + rank * 7 + tag, right, tag=tag)
            work.wait()
            expected = np.arange(count, dtype=np.int32) + left * 7 + tag
            if not np.array_equal(got, expected):
                problems.append(f"thread {index} round {round_number}: wrong payload")

    workers = [threading.Thread(target=run, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(120)
    return problems[:5] or None
