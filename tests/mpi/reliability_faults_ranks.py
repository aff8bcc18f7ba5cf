"""PYTHONPATH=. mpiexec -n P python tests/mpi/reliability_faults_ranks.py MODE TIMEOUT [FAULTY]

Fault injection on rank FAULTY (default 1; below "rank 1"), the others behave. On several hosts
the messages must also name the faulty rank's host ("rank 2 on host h1"). Modes the ranks
survive (exit 0 when every check held): ``skip`` (rank 1 skips a collective), ``different``
(rank 1 calls broadcast where the others call allreduce), ``mismatch`` (debug mode: rank 1
passes another shape), ``mismatch_op`` (debug: allreduce vs broadcast), ``thread_order`` (debug:
two threads issue two allreduces of different shapes, in one order on rank 0 and the other on
the rest). Modes that end the job (the test checks the exit status, the time and the message):
``exception``, ``exit``, ``kill`` (rank 1 dies while the others are in a collective),
``new_group_exit`` / ``new_group_hang`` (rank 1 exits, or hangs, after agreeing to a new group
and before creating it), and ``skip_uncaught``, ``different_uncaught`` (as ``skip`` and
``different``, with nobody catching the error: the job aborts on it). ``new_group_lists``
(surviving): rank 1 asks for another group.
"""

import os
import signal
import sys
import threading
import time

import numpy as np

import commlib
from commlib import CollectiveMismatchError, CommTimeoutError, GroupAbortedError
from tests.support.verdict import Checker

mode, timeout = sys.argv[1], float(sys.argv[2])
FAULTY = int(sys.argv[3]) if len(sys.argv) > 3 else 1
# Debug mode for "kill" too: its rank:pid map is how a SIGKILLed rank is named.
pg = commlib.init(timeout=timeout, debug=mode.startswith("mismatch") or mode in ("kill", "thread_order"))
rank = pg.rank
# How the others must name the faulty rank: with its host when the group spans hosts.
faulty_named = (f"rank {FAULTY} on host {pg.topology.host_name_of(FAULTY)}" if pg.topology.spans_hosts
                else f"rank {FAULTY}")
# One write per line (print writes the newline separately: lines of several ranks interleave).
sys.stdout.write(f"faults: rank {rank} pid {os.getpid()}\n")  # the test: none outlives the job
sys.stdout.flush()
check = Checker()
pg.allreduce(np.zeros(4))  # collective #1: everyone healthy
started = time.monotonic()

if mode in ("exception", "exit", "kill"):
    if rank == FAULTY:
        time.sleep(0.2)  # the others are already waiting in collective #2
        if mode == "exception":
            raise ValueError(f"injected failure on rank {FAULTY}")
        if mode == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    pg.allreduce(np.zeros(1 << 16, np.float32), algorithm="native")
    print(f"rank {rank}: collective #2 returned although rank {FAULTY} died", flush=True)
    sys.exit(0)

if mode in ("new_group_exit", "new_group_hang"):
    if rank == 1:
        from mpi4py import MPI

        from commlib.transports.mpi import transport as mpi_transport

        def fail_instead_of_splitting(*_args):
            if mode == "new_group_exit":
                return MPI.COMM_NULL  # skip the split: rank 1 goes on to exit normally
            time.sleep(timeout + 30)  # hangs where the peers wait in MPI_Comm_split

        mpi_transport.split_communicator = fail_instead_of_splitting
    pg.new_group([0, 1])
    if rank == 1:
        sys.exit(0)  # through the interpreter and MPI_Finalize, status 0: mpiexec sees no failure
    print(f"rank {rank}: new_group returned although rank 1 died", flush=True)
    sys.exit(0)
if mode == "skip_uncaught":
    if rank != FAULTY:
        pg.allreduce(np.ones(8))
    time.sleep(timeout + 5)  # rank 1 skipped the collective; the abort ends it
    sys.exit(0)
if mode == "different_uncaught":
    if rank == FAULTY:
        pg.broadcast(np.ones(8), 0)
    else:
        pg.allreduce(np.ones(8))
    sys.exit(0)

if mode == "skip":
    if rank != FAULTY:
        error = check.raises(CommTimeoutError, lambda: pg.allreduce(np.ones(8)), "skipped allreduce")
        if error is not None:
            elapsed = time.monotonic() - started
            text = str(error)
            check.check(elapsed < timeout + 3, f"timeout surfaced after {elapsed:.2f} s (limit {timeout} + 3)")
            for needle in ("allreduce #2", f"rank {rank}", faulty_named, "(last started allreduce #1)",
                           "timed out"):
                check.check(needle in text, f"message {text!r} lacks {needle!r}")
            print(f"rank {rank}: surfaced in {elapsed:.2f} s: {text}", flush=True)
        quick = time.monotonic()
        check.raises(GroupAbortedError, lambda: pg.barrier(), "later call after the error")
        check.check(time.monotonic() - quick < 1.0, "later call raised at once (not after a timeout)")
    else:
        time.sleep(timeout + 1)
elif mode == "different":
    call = (lambda: pg.broadcast(np.ones(8), 0)) if rank == FAULTY else (lambda: pg.allreduce(np.ones(8)))
    error = check.raises(CommTimeoutError, call, "allreduce vs broadcast")
    if error is not None:
        check.check(time.monotonic() - started < timeout + 3, "bounded time")
        if pg.size > 2 or rank == 0:
            check.check("out of step" in str(error) or "never heard" in str(error), f"names the peer: {error}")
        if rank != FAULTY:
            check.check(f"{faulty_named} (called broadcast #2 instead)" in str(error), f"names it: {error}")
        print(f"rank {rank}: {error}", flush=True)
elif mode == "mismatch":
    buf = np.zeros(1000, np.float32) if rank != FAULTY else np.zeros((10, 100), np.float32)
    before = buf.copy()
    error = check.raises(CollectiveMismatchError, lambda: pg.allreduce(buf), "shape mismatch")
    if error is not None:
        text = str(error)
        for needle in ("shape", "(1000,)", "(10, 100)", f"rank {FAULTY}", "allreduce",
                       f"{faulty_named} allreduce float32(10, 100)"):
            check.check(needle in text, f"message {text!r} lacks {needle!r}")
        print(f"rank {rank}: {text}", flush=True)
    check.equal(buf, before, "buffer untouched after a mismatch")
elif mode == "mismatch_op":
    call = (lambda: pg.broadcast(np.ones(8), 0)) if rank == FAULTY else (lambda: pg.allreduce(np.ones(8)))
    error = check.raises(CollectiveMismatchError, call, "allreduce vs broadcast in debug mode")
    if error is not None:
        text = str(error)
        check.check("collective differs" in text and "broadcast" in text and "allreduce" in text, text)
elif mode == "new_group_lists":
    asked = [0] if rank == 1 else [0, 1]
    error = check.raises(commlib.InvalidUsageError, lambda: pg.new_group(asked), "different member lists")
    if error is not None:
        check.check("rank 1: [0]" in str(error) and "rank 0: [0, 1]" in str(error), str(error))
    sub = pg.new_group(list(range(pg.size)))  # the group stays usable after the usage error
    buf = np.ones(3)
    sub.allreduce(buf)
    check.equal(buf, np.full(3, float(pg.size)), "allreduce on the group created afterwards")
elif mode == "thread_order":
    # Rule 1 of commlib/execution/executor.py: the program must issue in one order on every rank. Two
    # threads that issue in a rank-dependent order break it; the fingerprints must say so.
    shapes = {"first": (8,), "second": (4, 4)}
    order = ["first", "second"] if rank == 0 else ["second", "first"]
    works = {}

    def issue(name):
        try:
            works[name] = pg.allreduce(np.ones(shapes[name]), async_op=True)
        except GroupAbortedError:  # the first one failed already: the group is poisoned
            works[name] = None

    for name in order:
        thread = threading.Thread(target=issue, args=(name,))
        thread.start()
        thread.join()
    mismatches = []
    for name in order:
        try:
            if works[name] is not None:
                works[name].wait()
        except CollectiveMismatchError as exc:
            mismatches.append(str(exc))
        except GroupAbortedError:
            pass
    check.check(len(mismatches) == 1, f"one CollectiveMismatchError expected, got {mismatches}")
    for text in mismatches:
        check.check("shape differs" in text and "(8,)" in text and "(4, 4)" in text, text)
else:
    raise SystemExit(f"unknown mode {mode}")
check.finish()
