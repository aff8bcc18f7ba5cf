"""PYTHONPATH=. mpiexec -n P python tests/mpi/p2p_peer_exit_ranks.py

P >= 2. Rank 1 exits cleanly while the others wait to receive from it, blocking and nonblocking,
with a long timeout: each wait must end with PeerExitedError naming rank 1 (the timeout would
raise CommTimeoutError instead, after a minute). Rank 1 is gone, so the verdict is gathered over
a communicator of the survivors, made while rank 1 was still there; each survivor also prints one
line per wait, with how long it took.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import commlib
from commlib import PeerExitedError
from tests.support.verdict import Checker

TIMEOUT = 60.0


def wait_for_the_exited_peer(pg, check):
    rank = pg.rank
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
        check.check(ok, f"{what}: {outcome}")
        print(f"p2p_peer_exit: rank {rank}: {what}: {'OK' if ok else 'FAIL'} after "
              f"{time.monotonic() - started:.1f} s: {outcome}", flush=True)


def main():
    pg = commlib.init(timeout=TIMEOUT)
    survivors = MPI.COMM_WORLD.Split(MPI.UNDEFINED if pg.rank == 1 else 0, pg.rank)
    pg.barrier()  # every rank is up, its progress-board slot in place
    if pg.rank == 1:
        sys.exit(0)  # through the interpreter: the board says "exited"
    try:
        check = Checker(survivors)
        wait_for_the_exited_peer(pg, check)
        check.finish()
    finally:
        survivors.Free()


if __name__ == "__main__":
    main()
