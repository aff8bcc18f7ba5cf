"""PYTHONPATH=. mpiexec -n P python tests/mpi/shm_faults_ranks.py MODE ALGORITHM TIMEOUT

Faults while the ranks synchronise through shared memory (rank 1 is the faulty one):

* ``skip``: rank 1 skips a shared-memory allreduce; the others raise ``CommTimeoutError`` within
  the timeout naming rank 1, what they waited for and what the progress board knows, and the
  group then refuses every call at once. Exits 0 when every check held.
* ``vanish``: rank 1's process ends (``os._exit``, no MPI finalize: as after a crash the launcher
  does not report) while the others wait for it in shared memory; they raise ``CommError``
  naming it long before the timeout (they check that the peer process still exists). Every
  surviving rank prints one ``shm_faults: rank R named the lost peer after S s: MESSAGE`` line
  and leaves with ``os._exit(0)`` (there is no peer left to finish MPI with).
* ``sigkill``: every rank prints its pid, creates a sub-group (more segments), then kills
  itself with SIGKILL: the test then finds no segment file of any of them in /dev/shm.
* ``mixed``: ``auto`` on a 256 KiB allreduce with a symmetric buffer on even ranks and a plain one
  on odd ranks (a user's mistake: at P=2 the former takes shm_twoshot, the latter shm_oneshot):
  every rank raises ``CollectiveMismatchError`` saying the ranks chose different algorithms and
  why, within seconds, not after the timeout. (ALGORITHM is ignored.)
* ``mixed_movers``: ``auto`` on a 1 MiB allgather with every buffer symmetric on even ranks and
  a plain output on odd ranks (at P=2 the former takes shm_direct, the latter the MPI library's
  call): every rank raises ``CommTimeoutError`` within the timeout, and the ranks in shared memory
  say why. (ALGORITHM is ignored.)
"""

import os
import signal
import sys
import time

import numpy as np

import commlib
from commlib import CollectiveMismatchError, CommError, CommTimeoutError, GroupAbortedError
from commlib.reliability.abort import wait_until_stderr_read
from tests.support.verdict import Checker

mode, algorithm, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
pg = commlib.init(timeout=timeout)
rank = pg.rank
sys.stdout.write(f"shm_faults: rank {rank} pid {os.getpid()}\n")
sys.stdout.flush()
buf = pg.alloc(1 << 16, np.float32)  # symmetric, 256 KiB
pg.allreduce(buf, algorithm=algorithm)  # everyone healthy
started = time.monotonic()

if mode == "sigkill":
    sub = pg.new_group(list(range(pg.size)))
    pg.barrier()
    os.kill(os.getpid(), signal.SIGKILL)

if mode == "vanish":
    if rank == 1:
        time.sleep(0.3)  # the others are waiting for it by now
        os._exit(0)
    try:
        pg.allreduce(buf, algorithm=algorithm)
        message = "nothing raised"
    except CommError as exc:
        message = f"{type(exc).__name__}: {exc}"
    sys.stdout.write(f"shm_faults: rank {rank} named the lost peer after "
                     f"{time.monotonic() - started:.2f} s: {message}\n")
    sys.stdout.flush()
    # os._exit right after a write can lose the line: the launcher may stop reading a rank's pipe
    # once it has seen the process end. Leave only after the launcher has read it.
    wait_until_stderr_read(time.monotonic() + 5, fd=1)
    os._exit(0)

check = Checker()
if mode == "skip":
    if rank != 1:
        error = check.raises(CommTimeoutError, lambda: pg.allreduce(buf, algorithm=algorithm), "skipped allreduce")
        if error is not None:
            elapsed = time.monotonic() - started
            text = str(error)
            check.check(elapsed < timeout + 3, f"timeout surfaced after {elapsed:.2f} s (limit {timeout} + 3)")
            # alloc ran an allgather and an allreduce (#1, #2), the healthy allreduce was #3.
            ran = pg.resolve_algorithm(algorithm, buf.nbytes, symmetric=True)
            for needle in (f"rank {rank} on", f"allreduce #4, {ran}, 256 KiB", "in shared memory",
                           "rank 1 (pid", "to arrive", "never heard from rank 1 (last started allreduce #3)"):
                check.check(needle in text, f"message {text!r} lacks {needle!r}")
            print(f"rank {rank}: surfaced in {elapsed:.2f} s: {text}", flush=True)
        quick = time.monotonic()
        check.raises(GroupAbortedError, lambda: pg.allreduce(np.ones(2)), "later call after the error")
        check.check(time.monotonic() - quick < 1.0, "later call raised at once (not after a timeout)")
    else:
        time.sleep(timeout + 1)
elif mode == "mixed":
    plain = np.empty_like(buf)
    mine = buf if rank % 2 == 0 else plain
    mine[...] = 1
    error = check.raises(CollectiveMismatchError, lambda: pg.allreduce(mine), "auto on mixed buffers")
    elapsed = time.monotonic() - started
    check.check(elapsed < 10, f"the divergence surfaced after {elapsed:.2f} s (timeout {timeout} s)")
    if error is not None:
        for needle in ("the ranks chose different algorithms", "pg.alloc", "allreduce #4"):
            check.check(needle in str(error), f"message {str(error)!r} lacks {needle!r}")
elif mode == "mixed_movers":
    block = (1 << 20) // (4 * pg.size) + 1
    inp, shared_out = pg.alloc(block, np.int32), pg.alloc(block * pg.size, np.int32)
    out = shared_out if rank % 2 == 0 else np.empty_like(shared_out)
    inp[...] = rank
    begun = time.monotonic()
    error = check.raises(CommTimeoutError, lambda: pg.allgather(out, inp), "auto allgather on mixed outputs")
    elapsed = time.monotonic() - begun
    check.check(elapsed < timeout + 3, f"the divergence surfaced after {elapsed:.2f} s (timeout {timeout} s)")
    if error is not None:
        text = str(error)
        needles = ("allgather #", "1 MiB") + (("shm_direct", "pg.alloc", "choose differently") if rank % 2 == 0
                                             else ("the MPI library's allgather",))
        for needle in needles:
            check.check(needle in text, f"message {text!r} lacks {needle!r}")
else:
    raise SystemExit(f"unknown mode {mode}")
check.finish()
