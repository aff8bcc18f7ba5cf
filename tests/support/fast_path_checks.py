"""The small-message fast path (commlib/group/fast_path.py): taken when the line is empty, not taken
when something is in flight, and either way the same numbers and results. Called from
collectives_ranks.py (no mpiexec job of its own).

Counts, not timing: ``executor.inline_runs`` says which path ran, ``pg.seq`` the numbering.
"""

import itertools
import threading
import time
from typing import Any, Dict

import numpy as np

GATE_SECONDS = 30  # bound on waiting for the queued collective to show up (a hang otherwise)


def small_calls(pg):
    """(name, issue(), verify()) for every collective with a fast path, small plain buffers."""
    rank, size = pg.rank, pg.size
    root = size - 1
    state: Dict[str, Any] = {}

    def allreduce():
        state["allreduce"] = buf = np.full(3, rank + 1, np.int64)
        pg.allreduce(buf, algorithm="native")

    def broadcast():
        state["broadcast"] = buf = np.full(3, rank, np.int32)
        pg.broadcast(buf, root)

    def reduce():
        state["reduce"] = buf = np.full(3, rank + 1, np.float64)
        pg.reduce(buf, root, "max")  # a string op takes the fast path too

    def allgather():
        state["allgather"] = out = np.empty((size, 2), np.int16)
        pg.allgather(out, np.full(2, rank, np.int16))

    def reduce_scatter():
        state["reduce_scatter"] = out = np.empty(2, np.float32)
        pg.reduce_scatter(out, np.arange(2 * size, dtype=np.float32) + rank)

    def alltoall():
        state["alltoall"] = out = np.empty(size, np.int64)
        pg.alltoall(out, np.arange(size, dtype=np.int64) + 100 * rank, algorithm="native")

    def gather():
        state["gather"] = out = np.empty(size, np.uint8) if rank == root else None
        pg.gather(out, np.array([rank], np.uint8), root)

    def scatter():
        state["scatter"] = out = np.empty(1, np.float64)
        pg.scatter(out, np.arange(size, dtype=np.float64) * 2 if rank == root else None, root)

    def barrier():
        pg.barrier()

    expected = {
        "allreduce": lambda: np.full(3, size * (size + 1) // 2, np.int64),
        "broadcast": lambda: np.full(3, root, np.int32),
        "reduce": lambda: np.full(3, size if rank == root else rank + 1, np.float64),
        "allgather": lambda: np.repeat(np.arange(size, dtype=np.int16), 2).reshape(size, 2),
        "reduce_scatter": lambda: (np.arange(2 * size, dtype=np.float32)[2 * rank:2 * rank + 2] * size
                                   + sum(range(size))),
        "alltoall": lambda: np.arange(size, dtype=np.int64) * 100 + rank,
        "gather": lambda: np.arange(size, dtype=np.uint8) if rank == root else None,
        "scatter": lambda: np.array([2.0 * rank]),
    }
    calls = [allreduce, broadcast, reduce, allgather, reduce_scatter, alltoall, gather, scatter, barrier]
    return [(call.__name__, call, lambda name=call.__name__: (state.get(name), expected[name]()
                                                               if name in expected else None))
            for call in calls]


def check_inline_path(pg, check) -> None:
    executor = pg.executor
    fast = pg.size > 1 and not pg.debug  # one rank: nothing to gain; debug mode: fingerprints first
    for name, issue, results in small_calls(pg):
        # 1. Nothing in line: the fast path runs it, numbered next.
        wait_for_empty_line(executor)
        runs, seq = executor.inline_runs, pg.seq
        issue()
        check.check(executor.inline_runs - runs == (1 if fast else 0),
                    f"{name}: idle line, fast path ran {executor.inline_runs - runs} times, expected {int(fast)}")
        check.check(pg.seq == seq + 1, f"{name}: idle line, seq {seq} -> {pg.seq}, expected {seq + 1}")
        _check_results(check, name, "idle", *results())

        # 2. An async collective in flight: the same call queues behind it and its callback (the
        # ordering rule), takes the next number, and the fast path stays out of it.
        in_callback, gate = threading.Event(), threading.Event()
        before = np.full(4, pg.rank, np.int64)
        work = pg.allreduce(before, async_op=True)

        def hold_the_line(_work):
            in_callback.set()
            gate.wait(GATE_SECONDS)

        work.add_done_callback(hold_the_line)
        if not in_callback.wait(GATE_SECONDS):
            check.check(False, f"{name}: the async allreduce's callback did not run in {GATE_SECONDS} s")
            gate.set()
            continue
        runs, queued_before = executor.inline_runs, executor.pending()  # the blocked callback: 1
        issuer = threading.Thread(target=issue, name=f"issue-{name}")
        issuer.start()
        deadline = time.monotonic() + GATE_SECONDS
        while executor.pending() == queued_before and issuer.is_alive() and time.monotonic() < deadline:
            time.sleep(1e-4)
        queued = executor.pending() == queued_before + 1
        gate.set()
        issuer.join(GATE_SECONDS)
        check.check(queued, f"{name}: issued behind a running callback, it did not queue "
                            f"(pending {executor.pending()}, was {queued_before}; alive={issuer.is_alive()})")
        check.check(executor.inline_runs == runs, f"{name}: ran inline while the line was busy")
        check.check(pg.seq == work.seq + 1, f"{name}: numbered {pg.seq} after the async #{work.seq}; "
                                            f"expected {work.seq + 1}")
        check.equal(before, np.full(4, sum(range(pg.size)), np.int64), f"{name}: the async allreduce")
        _check_results(check, name, "queued", *results())

    # 3. Calls the fast path looks at and declines (a numpy integer as root; AVG, which divides
    # afterwards): the general path runs them, numbered next; the number the fast path took while
    # deciding under the lock is given back.
    buf = np.empty(4, np.float64)
    declined = (("broadcast with a numpy root", lambda: pg.broadcast(buf, np.int64(0)), 0.0),
                ("allreduce AVG", lambda: pg.allreduce(buf, "avg", algorithm="native"), (pg.size - 1) / 2))
    for name, issue, expected in declined:
        buf[...] = pg.rank
        runs, seq = executor.inline_runs, pg.seq
        issue()
        check.check(executor.inline_runs == runs, f"{name}: ran inline; expected the general path")
        check.check(pg.seq == seq + 1, f"{name}: seq {seq} -> {pg.seq}, expected {seq + 1}")
        check.equal(buf, np.full(4, expected), name)


def check_pair_paths_match(pg, check) -> None:
    """At two ranks broadcast and scatter run our binomial's one message on the fast path; a rank
    whose call takes the general path (here: ``async_op``) must send and receive the very same
    message, whichever rank is the root and whichever takes which path."""
    if pg.size != 2 or pg.debug:
        return
    executor, rank = pg.executor, pg.rank
    for algorithm, general_rank, root in itertools.product(("auto", "binomial"), (0, 1), (0, 1)):
        general = rank == general_rank
        for name in ("broadcast", "scatter"):
            wait_for_empty_line(executor)
            runs = executor.inline_runs
            out: np.ndarray
            if name == "broadcast":
                out = np.full((2, 3), rank, np.int32)
                work = pg.broadcast(out, root, algorithm=algorithm, async_op=general)
                expected = np.full((2, 3), root, np.int32)
            else:
                out = np.full(3, -1.0)
                inp = np.arange(6, dtype=np.float64).reshape(2, 3) * 10 + root if rank == root else None
                work = pg.scatter(out, inp, root, algorithm=algorithm, async_op=general)
                expected = (np.arange(3, dtype=np.float64) + 3 * rank) * 10 + root
            if work is not None:
                work.wait()
            what = f"{name} ({algorithm}) from root {root}, rank {general_rank} on the general path"
            check.equal(out, expected, what)
            check.check(executor.inline_runs - runs == (0 if general else 1),
                        f"{what}: rank {rank} ran {executor.inline_runs - runs} inline")
    # Empty buffers: binomial sends nothing, and neither does the fast path.
    for root in (0, 1):
        work = pg.broadcast(np.empty(0, np.float32), root, async_op=rank == root)
        if work is not None:
            work.wait()
        pg.scatter(np.empty(0), np.empty(0) if rank == root else None, root)
    token = np.array([rank], np.int64)
    pg.broadcast(token, 1)
    check.equal(token, np.array([1]), "a broadcast after the empty ones")


def wait_for_empty_line(executor) -> None:
    """Until the comm thread has counted off what it ran: it completes a Work (waking its waiter)
    before it takes the entry off the line, so a call right after ``wait()`` may still find the
    line busy and (rightly) take the general path. Bounded."""
    deadline = time.monotonic() + GATE_SECONDS
    while executor.pending() and time.monotonic() < deadline:
        time.sleep(1e-4)


def _check_results(check, name, when, actual, expected) -> None:
    if expected is None:
        return
    if actual is None:
        check.check(False, f"{name} ({when}): no output buffer")
        return
    check.equal(actual, expected.astype(actual.dtype), f"{name} ({when})")
