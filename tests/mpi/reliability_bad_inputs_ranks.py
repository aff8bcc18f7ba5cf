"""PYTHONPATH=. mpiexec -n P python tests/mpi/reliability_bad_inputs_ranks.py

Rank 0 gives one bad input per case and must get InvalidUsageError/TypeError naming what was
expected, before anything is sent and with its buffers untouched; the other ranks make the valid
call in a fresh group and must time out cleanly (CommTimeoutError), never hang.
"""

import time

import numpy as np

import commlib
from commlib import CommTimeoutError, InvalidUsageError, ReduceOp
from tests.support.verdict import Checker

PEER_TIMEOUT = 0.1  # the peers must time out (nothing is sent to them): no reason to wait long


def cases(size):
    good = lambda: np.arange(12, dtype=np.float32)  # noqa: E731
    readonly = good()
    readonly.setflags(write=False)
    shared = np.zeros(4 * size, np.float32)
    yield ("non-contiguous", InvalidUsageError, "C-contiguous", lambda g, b: g.allreduce(b[::2]), good())
    yield ("read-only", InvalidUsageError, "read-only", lambda g, b: g.allreduce(b), readonly)
    yield ("complex dtype", InvalidUsageError, "unsupported dtype complex64",
           lambda g, b: g.allreduce(b), np.zeros(4, np.complex64))
    yield ("object dtype", InvalidUsageError, "unsupported dtype object",
           lambda g, b: g.allreduce(b), np.array([1, "x"], dtype=object))
    yield ("bool dtype", InvalidUsageError, "unsupported dtype bool", lambda g, b: g.allreduce(b), np.zeros(4, bool))
    yield ("allgather size", InvalidUsageError, "expected world size",
           lambda g, b: g.allgather(np.zeros(b.size * size + 1, b.dtype), b), good())
    yield ("reduce_scatter size", InvalidUsageError, "expected world size",
           lambda g, b: g.reduce_scatter(np.zeros(b.size, b.dtype), b), good())
    yield ("overlapping buffers", InvalidUsageError, "overlap",
           lambda g, b: g.allgather(b, b[:4]), shared)
    yield ("root out of range", InvalidUsageError, f"expected 0 <= root < {size}",
           lambda g, b: g.broadcast(b, root=size), good())
    yield ("unknown algorithm", InvalidUsageError, "unknown allreduce algorithm 'fastest'",
           lambda g, b: g.allreduce(b, algorithm="fastest"), good())
    yield ("unknown op", InvalidUsageError, "unknown reduce op 'median'",
           lambda g, b: g.allreduce(b, op="median"), good())
    yield ("AVG on integers", InvalidUsageError, "AVG is undefined for integer",
           lambda g, b: g.allreduce(b, ReduceOp.AVG), np.arange(4, dtype=np.int32))
    yield ("not an array", TypeError, "expected a numpy.ndarray", lambda g, b: g.allreduce([1.0, 2.0]), good())
    # The other collectives, and point-to-point.
    yield ("unknown broadcast algorithm", InvalidUsageError, "unknown broadcast algorithm 'fastest'",
           lambda g, b: g.broadcast(b, algorithm="fastest"), good())
    yield ("algorithm not a str", InvalidUsageError, "allgather: algorithm must be a str",
           lambda g, b: g.allgather(np.zeros(b.size * size, b.dtype), b, algorithm=3), good())
    yield ("reduce root negative", InvalidUsageError, "root -1 out of range",
           lambda g, b: g.reduce(b, root=-1), good())
    yield ("gather root out of range", InvalidUsageError, f"root {size} out of range",
           lambda g, b: g.gather(np.zeros(b.size * size, b.dtype), b, root=size), good())
    yield ("gather without out on the root", InvalidUsageError, "out is None; expected an array on the root",
           lambda g, b: g.gather(None, b, root=0), good())
    yield ("gather out size", InvalidUsageError, "expected world size",
           lambda g, b: g.gather(np.zeros(b.size * size + 1, b.dtype), b, root=0), good())
    yield ("scatter without inp on the root", InvalidUsageError, "inp is None",
           lambda g, b: g.scatter(b, None, root=0), good())
    yield ("scatter inp size", InvalidUsageError, "expected world size",
           lambda g, b: g.scatter(b[:2], np.zeros(2 * size - 1, b.dtype), root=0), good())
    yield ("alltoall unequal blocks", InvalidUsageError, f"a multiple of the world size {size}",
           lambda g, b: g.alltoall(np.zeros(3 * size + 1, b.dtype), np.zeros(3 * size + 1, b.dtype)), good())
    yield ("alltoallv negative count", InvalidUsageError, "in_counts[1] is -1",
           lambda g, b: g.alltoallv(b, b.copy(), [12] + [0] * (size - 1), [13, -1] + [0] * (size - 2)), good())
    yield ("alltoallv counts per rank", InvalidUsageError, "in_counts has 1 entries",
           lambda g, b: g.alltoallv(b, b.copy(), [12] + [0] * (size - 1), [12]), good())
    yield ("alltoallv counts total", InvalidUsageError, "out_counts add up to 11 elements; expected out.size = 12",
           lambda g, b: g.alltoallv(b, b.copy(), [11] + [0] * (size - 1), [12] + [0] * (size - 1)), good())
    yield ("send tag", InvalidUsageError, "tag -1 out of range", lambda g, b: g.send(b, 1, tag=-1), good())
    yield ("recv from itself", InvalidUsageError, "rank 0 cannot exchange a message with itself",
           lambda g, b: g.recv(b, 0), good())


def main():
    world = commlib.init(timeout=30)
    check = Checker()
    size = world.size
    for name, error_type, needle, call, buf in cases(size):
        group = world.new_group(list(range(size)), timeout=PEER_TIMEOUT)
        if world.rank == 0:
            before = np.array(buf, copy=True)
            error = check.raises(error_type, lambda: call(group, buf), name, match=needle)
            if error is not None:
                print(f"{name}: {type(error).__name__}: {error}", flush=True)
            check.check(before.dtype == object or np.array_equal(before, buf), f"{name}: buffer untouched")
        else:
            started = time.monotonic()
            check.raises(CommTimeoutError, lambda: group.allreduce(np.ones(12, np.float32)), f"peer of {name}")
            elapsed = time.monotonic() - started
            check.check(elapsed < PEER_TIMEOUT + 4, f"peer of {name}: timed out after {elapsed:.2f} s")
        group.close()
        world.barrier()

    if world.rank == 0:
        check.raises(InvalidUsageError, lambda: world.new_group([0], timeout=-1), "negative timeout", match="timeout")
        w = commlib.Work("allreduce", 1)
        check.raises(ValueError, lambda: w.wait(timeout=-1), "Work.wait negative timeout", match="timeout")
        # MPI cannot end one communicator's collective: said before anything happens
        check.raises(InvalidUsageError, lambda: world.abort("test"), "abort of an MPI group",
                     match="cannot be interrupted")
    world.barrier()
    check.finish()


if __name__ == "__main__":
    main()
