"""PYTHONPATH=. mpiexec (across 2 hosts, see the test) python tests/multihost/hostile_multihost_ranks.py DIR

A job that a third host attacks while it runs (tests/multihost/test_hostile_multihost.py). The
test and the ranks meet through files in ``DIR`` (the hosts are namespaces of one machine: one
filesystem); every wait is bounded, so a test that stops feeding files ends the job, never hangs it.

1. ``commlib.init()``: the crash witness's query port listens on each host. Each rank writes
   ``DIR/rank{r}.json`` (pid, host, the witness's endpoint), then runs allreduces with closed forms
   until ``DIR/stop-steady`` exists.
2. A socket transport over MPI with the job's secret: while its mesh forms, the last rank connects
   only once ``DIR/go-1`` exists (rank 0 wrote its listener's endpoints to ``DIR/listening-1.json``).
   Its collectives exact.
3. That transport's point-to-point channel (a mesh of its own, formed the same way:
   ``listening-2.json``, ``go-2``): messages with closed forms.
"""

import json
import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

import commlib
from commlib import ReduceOp
from commlib.group.socket_p2p import SocketPointToPoint
from commlib.reliability.crash_witness import witness_endpoint, witness_secret
from commlib.rendezvous.mpi import MPIRendezvous
from commlib.transports.socket import SocketOptions, SocketTransport
from tests.support.verdict import Checker

WAIT = 300.0  # seconds any phase waits for the test's next file


def wait_for(path: str) -> None:
    deadline = time.monotonic() + WAIT
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def write(path: str, value) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(value, handle)
    os.replace(path + ".tmp", path)


def _is_endpoints(result) -> bool:
    """Whether an allgather's result is a mesh's endpoint exchange (every rank's [(address, port)])."""
    return (isinstance(result, list) and bool(result) and all(isinstance(entry, list) for entry in result)
            and bool(result[0]) and all(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], int)
                                        for pair in result[0]))


class LateLastRank:
    """A rendezvous whose k-th mesh endpoint exchange holds the last rank until ``DIR/go-k`` exists
    (rank 0's listener stays open meanwhile: what the stranger knocks at)."""

    def __init__(self, inner, folder: str):
        self.inner, self.folder, self.meshes = inner, folder, 0
        self.rank, self.size, self.kind = inner.rank, inner.size, inner.kind

    def allgather(self, obj):
        result = self.inner.allgather(obj)
        if _is_endpoints(result):
            self.meshes += 1
            if self.rank == 0:
                write(os.path.join(self.folder, f"listening-{self.meshes}.json"), result[0])
            if self.rank == self.size - 1:
                wait_for(os.path.join(self.folder, f"go-{self.meshes}"))
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


def steady(pg, check, folder: str) -> int:
    rank, size = pg.rank, pg.size
    calls = 0
    deadline = time.monotonic() + WAIT
    stop = os.path.join(folder, "stop-steady")
    while time.monotonic() < deadline:
        big = np.full(1 << 18, rank + 1, np.float32)
        small = np.arange(8, dtype=np.int64) * (rank + 1)
        pg.allreduce(big)
        pg.allreduce(small, ReduceOp.MAX)
        check.equal(big, np.full(1 << 18, size * (size + 1) / 2, np.float32), f"allreduce #{calls}")
        check.equal(small, np.arange(8) * size, f"allreduce max #{calls}")
        calls += 1
        done = np.array([os.path.exists(stop)], np.int64)
        pg.allreduce(done, ReduceOp.MAX)  # every rank stops after the same call
        if done[0]:
            return calls
    raise TimeoutError("stop-steady never appeared")


def main(folder: str) -> None:
    pg = commlib.init(timeout=120)
    rank, size = pg.rank, pg.size
    check = Checker()
    write(os.path.join(folder, f"rank{rank}.json"),
          {"pid": os.getpid(), "host": socket.gethostname(), "witness": witness_endpoint()})
    calls = steady(pg, check, folder)
    check.check(calls > 0, "no allreduce ran while the witness was attacked")
    secret = witness_secret()
    check.check(secret is not None, "the job has no secret")
    late = LateLastRank(MPIRendezvous(MPI.COMM_WORLD.Dup()), folder)
    transport = SocketTransport(late, secret, options=SocketOptions(handshake_timeout=3.0), timeout=WAIT)
    for seq, count in enumerate((8, 100003), 1):
        transport.context.begin("allreduce", seq, "native", count * 8, 60)
        buf = np.arange(count, dtype=np.int64) + rank
        transport.native_allreduce(buf, ReduceOp.SUM)
        check.equal(buf, np.arange(count) * size + size * (size - 1) // 2, f"socket allreduce n={count}")
    p2p = SocketPointToPoint(transport, timeout=WAIT, name="hostile")
    right, left = (rank + 1) % size, (rank - 1) % size
    for count in (1, 5000, 1 << 20):
        got = np.empty(count, np.int32)
        work = p2p.irecv(got, left, tag=count % 1000)
        p2p.send(np.arange(count, dtype=np.int32) * 7 + rank, right, tag=count % 1000)
        work.wait()
        check.equal(got, np.arange(count, dtype=np.int32) * 7 + left, f"socket p2p n={count}")
    p2p.close()
    transport.free_communicator()
    pg.barrier()
    print(f"hostile: rank {rank}: {calls} steady calls, meshes {late.meshes}", flush=True)
    commlib.shutdown()
    check.finish()


if __name__ == "__main__":
    main(sys.argv[1])
