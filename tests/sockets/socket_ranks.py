"""What the ranks of a :class:`tests.support.socket_world.SocketWorld` run (``state`` is the rank's
transport, rendezvous and store). Each returns something small the test compares."""

from __future__ import annotations

import os
import resource
import time

import numpy as np

from commlib import ReduceOp
from commlib.algorithms.registry import get_algorithm
from commlib.ops import DTYPE_IS_FLOAT
from commlib.topology import Topology
from commlib.transports.socket.connection import PREFETCH_BYTES
from commlib.transports.socket.fast_path import make_inline_native
from tests.sockets.cases import cases
from tests.support.socket_world import process_group


def _begin(state, collective, algorithm="", nbytes=0, timeout=60.0):
    state.seq = getattr(state, "seq", 0) + 1
    state.transport.context.begin(collective, state.seq, algorithm, nbytes, timeout)


def run_matrix(state, collective, name, shape=None):
    """Every case of ``collective`` with algorithm ``name``; the first problems found, or None."""
    transport = state.transport
    fn = get_algorithm(name, collective)
    saved = transport.topology
    if shape is not None:
        transport.topology = Topology.from_shape(state.rank, shape)
    try:
        checks = []
        for label, call, check in cases(collective, state.size, state.rank):
            _begin(state, collective, name)
            call(fn, transport)
            checks.append((label, check))
    finally:
        transport.topology = saved
    problems = [f"{label}: {problem}" for label, check in checks if (problem := check()) is not None]
    return problems[:3] or None


def run_barrier(state, name, rounds=3):
    """A barrier lets no rank out before every rank entered: each rank records its entry in the
    store first (the last rank late), and on leaving every entry must be there."""
    fn = get_algorithm(name, "barrier")
    late = []
    for round_number in range(rounds):
        _begin(state, "barrier", name)
        key = f"barrier/{name}/{state.seq}"
        if state.rank == (round_number + state.size - 1) % state.size:
            time.sleep(0.05)
        state.store.set(f"{key}/{state.rank}", b"in")
        fn(state.transport, segment_bytes=8)
        missing = state.store.missing([f"{key}/{rank}" for rank in range(state.size)])
        if missing:
            late.append(f"round {round_number}: left before {missing} entered")
    return late or None


def allreduce_loop(state, seconds, count=1 << 16):
    """Allreduce (native, ring at this size) until an error or ``seconds``: (error type, text, when)."""
    buf = np.ones(count, np.float32)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        _begin(state, "allreduce", "native", buf.nbytes, timeout=120.0)
        try:
            state.transport.native_allreduce(buf, ReduceOp.SUM)
        except Exception as error:  # noqa: BLE001 - the test looks at it
            return type(error).__name__, str(error), time.monotonic()
        buf[...] = 1
    return None


def pid(state):
    return os.getpid()


def refusals(state):
    return list(state.refusals)


def max_rss_bytes(state):
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def receive(state, count, timeout=30.0):
    """Post one receive of ``count`` bytes from rank 1 (what a stranger-rank feeds): outcome text."""
    buf = np.zeros(count, np.uint8)
    _begin(state, "allreduce", "native", count, timeout)
    try:
        state.transport.recv(buf, 1)
    except Exception as error:  # noqa: BLE001 - the test looks at it
        return type(error).__name__, str(error)
    return "ok", bytes(buf[:16])


def sum_of_ranks(state):
    buf = np.full(5, state.rank + 1, np.int64)
    _begin(state, "allreduce", "native", buf.nbytes)
    state.transport.native_allreduce(buf, ReduceOp.SUM)
    return buf.tolist()


def close_transport(state):
    state.transport.free_communicator()
    return None


def barrier_then_close(state):
    _begin(state, "barrier", "native")
    state.transport.native_barrier()
    state.transport.free_communicator()
    return state.seq


def broadcast_from(state, root, timeout):
    buf = np.zeros(4, np.int32) + (7 if state.rank == root else 0)
    _begin(state, "broadcast", "native", buf.nbytes, timeout)
    try:
        state.transport.native_broadcast(buf, root)
    except Exception as error:  # noqa: BLE001 - the test looks at it
        return type(error).__name__, str(error)
    return "ok", buf.tolist()


def sleep(state, seconds):
    time.sleep(seconds)
    return None


def exchange_with_timeout(state, timeout, label):
    """Rank 0 waits for 8 bytes from rank 1 (which does not send): the timeout's message."""
    buf = np.zeros(8, np.uint8)
    _begin(state, "allreduce", "ring", 8, timeout)
    state.transport.step(label)
    try:
        state.transport.exchange(recvs=((buf, 1),))
    except Exception as error:  # noqa: BLE001 - the test looks at it
        return type(error).__name__, str(error)
    return "ok", None


def next_collective(state, timeout):
    """What a rank meets in its next collective after a peer aborted."""
    buf = np.ones(8, np.uint8)
    _begin(state, "allreduce", "native", 8, timeout)
    try:
        state.transport.native_allreduce(buf, ReduceOp.SUM)
    except Exception as error:  # noqa: BLE001 - the test looks at it
        return type(error).__name__, str(error)
    return "ok", None


def broadcast_then_close(state, root, rounds):
    """Broadcasts from ``root``; each rank closes its transport as soon as its part is done."""
    buf = np.zeros(3, np.int64)
    for round_number in range(rounds):
        buf[...] = round_number if state.rank == root else -1
        _begin(state, "broadcast", "native", buf.nbytes)
        state.transport.native_broadcast(buf, root)
        if buf.tolist() != [round_number] * 3:
            return f"round {round_number}: {buf.tolist()}"
    state.transport.free_communicator()
    return None


def algorithms_over(state, names):
    """A few allreduce algorithms on a large and a small input: the sums, checked here."""
    problems = []
    for name in names:
        for count in (3, 300001):
            buf = np.arange(count, dtype=np.float64) + state.rank
            _begin(state, "allreduce", name, buf.nbytes)
            get_algorithm(name)(state.transport, buf, ReduceOp.SUM, segment_bytes=1 << 16)
            expected = np.arange(count, dtype=np.float64) * state.size + state.size * (state.size - 1) / 2
            if not np.array_equal(buf, expected):
                problems.append(f"{name} n={count}: index {np.flatnonzero(buf != expected)[0]}")
    return problems or None


def group_small_allreduces(state):
    """The group's small allreduce (``native``) for every dtype and op at a few sizes, checked
    exactly; each case with rank 0 on the general path (``async_op``) while the others take the
    fast path (the two must send the same frames), then on it everywhere. (problems, calls the
    fast path ran, calls it should have run)."""
    group = process_group(state, "small")
    fast_possible = make_inline_native(state.transport, "allreduce", 1.0) is not None
    ops = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum, ReduceOp.PROD: np.multiply}
    problems, ran, due = [], 0, 0
    for dtype in DTYPE_IS_FLOAT:
        for op, ufunc in ops.items():
            for count in (1, 3, 1000, 20000):  # 20000: above one frame of the fast path at every dtype
                def values(rank, count=count, op=op):
                    index = np.arange(count)
                    return ((index + rank) % 2 + 1 if op is ReduceOp.PROD else index % 7 + rank).astype(dtype)

                expected = values(0)
                for rank in range(1, state.size):
                    expected = ufunc(expected, values(rank))
                for call in ("rank 0 async", "all fast"):
                    buf = values(state.rank)
                    if call == "rank 0 async" and state.rank == 0:
                        group.allreduce(buf, op, algorithm="native", async_op=True).wait()
                        while group.executor.pending():  # its thread's bookkeeping, just after the
                            time.sleep(1e-4)            # wait returned: the next call would find it busy
                    else:
                        before = group.executor.inline_runs
                        group.allreduce(buf, op, algorithm="native")
                        ran += group.executor.inline_runs - before
                        due += fast_possible and buf.nbytes <= PREFETCH_BYTES
                    if buf.tobytes() != expected.tobytes():
                        problems.append(f"{dtype} {op.name} n={count} {call}: "
                                        f"{buf[:4].tolist()} != {expected[:4].tolist()}")
    return problems[:3] or None, ran, due


def group_allreduce_loop(state, seconds):
    """The group's 16-byte allreduce until an error or ``seconds``: (error type, text, when)."""
    group = process_group(state, "loop")
    buf = np.ones(2, np.float64)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            group.allreduce(buf, algorithm="native")
        except Exception as error:  # noqa: BLE001 - the test looks at it
            return type(error).__name__, str(error), time.monotonic()
        buf[...] = 1
    return None
