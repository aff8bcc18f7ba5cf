"""mpiexec -n P python tests/mpi/faults.py MODE TIMEOUT

Fault injection on rank 1 (the others behave). Modes the ranks survive (exit 0 when every check
held): ``skip`` (rank 1 skips a collective), ``different`` (rank 1 calls broadcast where the others
call allreduce), ``mismatch`` (debug mode: rank 1 passes another shape), ``mismatch_op``
(debug: allreduce vs broadcast). Modes that end the job (the test checks the exit status, the
time and the message): ``exception``, ``exit``, ``kill`` (rank 1 dies while the others are in a
collective).
"""

import os
import signal
import sys
import time

import numpy as np

import commlib
from commlib import CollectiveMismatchError, CommTimeoutError, GroupAbortedError
from verdict import Checker

mode, timeout = sys.argv[1], float(sys.argv[2])
# Debug mode for "kill" too: its rank:pid map is how a SIGKILLed rank is named.
pg = commlib.init(timeout=timeout, debug=mode.startswith("mismatch") or mode == "kill")
rank = pg.rank
check = Checker()
pg.allreduce(np.zeros(4))  # collective #1: everyone healthy
started = time.monotonic()

if mode in ("exception", "exit", "kill"):
    if rank == 1:
        time.sleep(0.2)  # the others are already waiting in collective #2
        if mode == "exception":
            raise ValueError("injected failure on rank 1")
        if mode == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    pg.allreduce(np.zeros(1 << 16, np.float32), algorithm="native")
    print(f"rank {rank}: collective #2 returned although rank 1 died", flush=True)
    sys.exit(0)

if mode == "skip":
    if rank != 1:
        error = check.raises(CommTimeoutError, lambda: pg.allreduce(np.ones(8)), "skipped allreduce")
        if error is not None:
            elapsed = time.monotonic() - started
            text = str(error)
            check.check(elapsed < timeout + 3, f"timeout surfaced after {elapsed:.2f} s (limit {timeout} + 3)")
            for needle in ("allreduce #2", f"rank {rank}", "rank 1", "timed out"):
                check.check(needle in text, f"message {text!r} lacks {needle!r}")
            print(f"rank {rank}: surfaced in {elapsed:.2f} s: {text}", flush=True)
        quick = time.monotonic()
        check.raises(GroupAbortedError, lambda: pg.barrier(), "later call after the error")
        check.check(time.monotonic() - quick < 0.5, "later call raised at once")
    else:
        time.sleep(timeout + 1)
elif mode == "different":
    call = (lambda: pg.broadcast(np.ones(8), 0)) if rank == 1 else (lambda: pg.allreduce(np.ones(8)))
    error = check.raises(CommTimeoutError, call, "allreduce vs broadcast")
    if error is not None:
        check.check(time.monotonic() - started < timeout + 3, "bounded time")
        if pg.size > 2 or rank == 0:
            check.check("out of step" in str(error) or "never heard" in str(error), f"names the peer: {error}")
        print(f"rank {rank}: {error}", flush=True)
elif mode == "mismatch":
    buf = np.zeros(1000, np.float32) if rank != 1 else np.zeros((10, 100), np.float32)
    before = buf.copy()
    error = check.raises(CollectiveMismatchError, lambda: pg.allreduce(buf), "shape mismatch")
    if error is not None:
        text = str(error)
        for needle in ("shape", "(1000,)", "(10, 100)", "rank 1", "allreduce"):
            check.check(needle in text, f"message {text!r} lacks {needle!r}")
        print(f"rank {rank}: {text}", flush=True)
    check.equal(buf, before, "buffer untouched after a mismatch")
elif mode == "mismatch_op":
    call = (lambda: pg.broadcast(np.ones(8), 0)) if rank == 1 else (lambda: pg.allreduce(np.ones(8)))
    error = check.raises(CollectiveMismatchError, call, "allreduce vs broadcast in debug mode")
    if error is not None:
        text = str(error)
        check.check("collective differs" in text and "broadcast" in text and "allreduce" in text, text)
else:
    raise SystemExit(f"unknown mode {mode}")
check.finish()
