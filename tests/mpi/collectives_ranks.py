"""PYTHONPATH=. mpiexec -n P python tests/mpi/collectives_ranks.py [algorithm ...]

Every collective of the public API against a closed-form result, with inputs derived from the
rank: dtypes x ops x odd sizes (0, 1, < P, not divisible by P), sync and async; sub-groups, and
a group collected without close().
"""

import gc
import sys

import numpy as np
from mpi4py import MPI

import commlib
from commlib import InvalidUsageError, ReduceOp
from tests.support.fast_path_checks import check_inline_path, check_pair_paths_match
from tests.support.closed_form import DTYPES, OPS, small_values, small_values_reduced
from tests.support.verdict import Checker


def check_a_collected_group_is_freed_at_the_next_safe_point(pg, check):
    """A group collected without close() frees its communicators at the next group created, never
    inside the collection: a collection can run while mpi4py holds its own lock, and
    MPI_Comm_free's attribute callback took that lock again (a rank deadlocked with itself: see
    commlib/reliability/teardown.py)."""
    group = pg.new_group(list(range(pg.size)))
    comms = [comm for comm in (group.transport.comm, getattr(group.p2p, "comm", None)) if comm is not None]
    buf = np.ones(3)
    group.allreduce(buf)
    check.equal(buf, np.full(3, float(pg.size)), "allreduce in the group that is then dropped")
    cycle = [group]
    cycle.append(cycle)  # only the cycle collector frees it, at a moment nobody chooses
    del group, cycle
    gc.collect()
    check.check(all(comm != MPI.COMM_NULL for comm in comms),
                f"none of the {len(comms)} communicators of a collected group is freed inside the collection")
    pg.new_group(list(range(pg.size))).close()
    check.check(all(comm == MPI.COMM_NULL for comm in comms),
                "a collected group's communicators are freed when the next group is created")


def main():
    algorithms = sys.argv[1:] or ["auto"]
    pg = commlib.init(timeout=60)
    rank, size = pg.rank, pg.size
    check = Checker()
    counts = sorted({0, 1, max(size - 1, 1), size, 7 * size + 3, 1001})
    for algorithm in algorithms:
        for dtype in DTYPES:
            dtype = np.dtype(dtype)
            is_float = dtype.kind == "f" or dtype.name == "bfloat16"
            for op in OPS:
                if op is ReduceOp.AVG and not is_float:
                    check.raises(InvalidUsageError, lambda: pg.allreduce(np.ones(4, dtype), op),
                                 f"AVG on {dtype}", match="AVG")
                    continue
                if op is ReduceOp.PROD and size > 4 and dtype.itemsize == 1:
                    continue  # 3**8 overflows 8-bit types; the overflow itself is not under test
                for count in counts:
                    for async_op in (False, True):
                        buf = small_values(rank, count, dtype).reshape(-1, 1) if count else small_values(rank, 0, dtype)
                        work = pg.allreduce(buf, op, algorithm=algorithm, async_op=async_op)
                        if async_op:
                            work.wait()
                        expected = small_values_reduced(size, count, op)
                        what = f"allreduce {algorithm} {dtype} {op.name} n={count} async={async_op}"
                        check.close(buf.reshape(-1).astype(np.float64), expected, what,
                                    rtol=1e-2 if dtype.itemsize == 2 else 1e-6)

    # broadcast / reduce from every root
    for root in range(size):
        buf = small_values(rank, 13, np.int64) * (rank + 1)
        pg.broadcast(buf, root=root)
        check.equal(buf, small_values(root, 13, np.int64) * (root + 1), f"broadcast root={root}")
        buf = small_values(rank, 13, np.float32)
        pg.reduce(buf, root=root, op=ReduceOp.SUM)
        if rank == root:
            check.close(buf, small_values_reduced(size, 13, ReduceOp.SUM), f"reduce root={root}")
        else:
            check.equal(buf, small_values(rank, 13, np.float32), f"reduce root={root} leaves non-root input")

    # allgather / reduce_scatter, odd block sizes, rank-major
    for block in (0, 1, 5):
        inp = np.full(block, rank, np.int32)
        out = np.empty(block * size, np.int32)
        pg.allgather(out, inp)
        check.equal(out, np.repeat(np.arange(size, dtype=np.int32), block), f"allgather block={block}")
        inp = np.arange(block * size, dtype=np.float64) + rank
        out = np.empty(block, np.float64)
        inp_before = inp.copy()
        pg.reduce_scatter(out, inp, ReduceOp.SUM)
        expected = np.arange(block * size, dtype=np.float64)[rank * block:(rank + 1) * block] * size + sum(range(size))
        check.equal(out, expected, f"reduce_scatter block={block}")
        check.equal(inp, inp_before, f"reduce_scatter leaves inp unchanged block={block}")

    # async works complete in issue order; wait re-raises nothing on success
    bufs = [np.full(100, rank + i, np.float64) for i in range(20)]
    works = [pg.allreduce(b, async_op=True) for b in bufs]
    for i, (work, buf) in enumerate(zip(works, bufs)):
        check.check(work.wait() is True, f"work {i}.wait() returned True")
        check.equal(buf, np.full(100, sum(range(size)) + size * i, np.float64), f"async allreduce {i}")
    pg.barrier()

    # sub-groups: even ranks
    members = list(range(0, size, 2))
    sub = pg.new_group(members)
    if rank in members:
        check.check(sub is not None and sub.size == len(members), "new_group size")
        buf = np.array([rank], np.int64)
        sub.allreduce(buf)
        check.equal(buf, np.array([sum(members)]), "allreduce in sub-group")
    else:
        check.check(sub is None, "non-member gets None from new_group")

    check_a_collected_group_is_freed_at_the_next_safe_point(pg, check)
    check_inline_path(pg, check)
    check_pair_paths_match(pg, check)
    check.check(commlib.world() is pg and commlib.init() is pg, "init is idempotent")
    check.finish()


if __name__ == "__main__":
    main()
