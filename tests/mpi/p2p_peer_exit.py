"""mpiexec -n P python tests/mpi/p2p_peer_exit.py  (P >= 2)

Rank 1 exits cleanly while the others wait to receive from it, blocking and nonblocking, with a
long timeout: each wait must end with PeerExitedError naming rank 1 (the timeout would raise
CommTimeoutError instead, after a minute). Rank 1 is gone, so there is no cross-rank verdict:
each survivor prints one line per check, and the test reads them.
"""

import sys
import time

import numpy as np

import commlib
from commlib import PeerExitedError

TIMEOUT = 60.0

pg = commlib.init(timeout=TIMEOUT)
rank = pg.rank
pg.barrier()  # every rank is up, its progress-board slot in place
if rank == 1:
    sys.exit(0)  # through the interpreter: the board says "exited"

failures = 0
pending = pg.irecv(np.empty(4, np.float64), 1)
for what, wait in (("recv", lambda: pg.recv(np.empty(4, np.float64), 1, tag=3)), ("irecv", pending.wait)):
    started = time.monotonic()
    try:
        wait()
        outcome = "returned"
    except PeerExitedError as exc:
        outcome = f"PeerExitedError: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported
        outcome = f"{type(exc).__name__}: {exc}"
    ok = outcome.startswith("PeerExitedError") and "rank 1 exited" in outcome and f"rank {rank}:" in outcome
    failures += not ok
    print(f"p2p_peer_exit: rank {rank}: {what}: {'OK' if ok else 'FAIL'} after "
          f"{time.monotonic() - started:.1f} s: {outcome}", flush=True)
sys.exit(1 if failures else 0)
