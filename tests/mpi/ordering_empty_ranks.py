"""PYTHONPATH=. mpiexec -n P python tests/mpi/ordering_empty_ranks.py

An empty collective keeps the ranks in step whichever path each rank takes.

Rank 0 issues each empty collective synchronously on an idle group (the small-message fast path,
which starts the MPI library's call in the caller's thread); the other ranks issue it with
``async_op`` (the general path, queued). Then every rank runs a checked allreduce of its own
values, again through the library. The general path makes no MPI call for an empty buffer, and
MPICH numbers even a zero-count nonblocking collective, so a fast path that called it anyway put
rank 0 one library collective ahead: the next allreduce paired with the wrong one (PowerSGD's
empty allreduce of uncompressed tensors hung, or returned another collective's bytes).
"""

import numpy as np

import commlib
from commlib import ReduceOp
from tests.support.verdict import Checker

ROUNDS = 3


def empty_calls(pg):
    """(name, call(async_op)) for every collective with an empty buffer, each on the library's algorithm."""
    nothing = np.zeros(0, np.float64)
    out = np.zeros(0, np.float64)
    return [
        ("allreduce", lambda a: pg.allreduce(nothing, algorithm="native", async_op=a)),
        ("broadcast", lambda a: pg.broadcast(nothing, 0, algorithm="native", async_op=a)),
        ("reduce", lambda a: pg.reduce(nothing, 0, ReduceOp.SUM, algorithm="native", async_op=a)),
        ("allgather", lambda a: pg.allgather(np.zeros(0), nothing, algorithm="native", async_op=a)),
        ("reduce_scatter", lambda a: pg.reduce_scatter(out, np.zeros(0), algorithm="native", async_op=a)),
        ("alltoall", lambda a: pg.alltoall(np.zeros(0), nothing, algorithm="native", async_op=a)),
        ("gather", lambda a: pg.gather(np.zeros(0) if pg.rank == 0 else None, nothing, 0,
                                       algorithm="native", async_op=a)),
        ("scatter", lambda a: pg.scatter(out, np.zeros(0) if pg.rank == 0 else None, 0,
                                         algorithm="native", async_op=a)),
        ("allreduce auto", lambda a: pg.allreduce(nothing, async_op=a)),
        ("broadcast auto", lambda a: pg.broadcast(nothing, 0, async_op=a)),
    ]


def main():
    pg = commlib.init()
    check = Checker()
    expected = np.full(4, pg.size * (pg.size + 1) / 2)
    for round_ in range(ROUNDS):
        for name, call in empty_calls(pg):
            work = call(pg.rank != 0)  # rank 0: sync on an idle group; the others: queued
            if work is not None:
                work.wait()
            values = np.full(4, pg.rank + 1.0)
            pg.allreduce(values, algorithm="native")  # meets the peers' only if nothing went astray
            check.equal(values, expected, f"round {round_}: an allreduce after an empty {name}")
    check.finish()


if __name__ == "__main__":
    main()
