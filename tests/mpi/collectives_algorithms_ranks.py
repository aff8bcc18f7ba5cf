"""PYTHONPATH=. mpiexec -n P python tests/mpi/collectives_algorithms_ranks.py [segment_bytes]

Every algorithm of every collective other than allreduce (collectives_allreduce_ranks.py has those), plus
"auto", through the public ``ProcessGroup`` methods, sync and async in turn, with a tiny
``segment_bytes`` so the pipelined paths run on short inputs: dtypes x ops x odd sizes (0, 1,
< P, P, not divisible by P) x roots against closed forms (exact: small integers); random bytes
through the data-movement collectives must arrive bit for bit (NaN payloads included) and be
identical on every rank that holds them; alltoallv counts that disagree raise on every rank
with nothing sent, after which the group still works.
"""

import hashlib
import sys

import numpy as np

import commlib
from commlib import InvalidUsageError, ReduceOp
from tests.support.closed_form import DTYPES, OPS, closed_form, random_bytes, rank_values
from tests.support.verdict import Checker

COUNTS_EXTRA = 301  # many 16-byte segments


def tagged(rank, count, dtype, salt=0):
    return ((np.arange(count) * 7 + rank * 31 + salt * 5) % 97).astype(dtype)


class Runner:
    """Alternates sync and async calls, so both paths run over the whole matrix."""

    def __init__(self):
        self.calls = 0

    def __call__(self, method, *args, **kwargs):
        self.calls += 1
        if self.calls % 2:
            method(*args, **kwargs)
            return "sync"
        work = method(*args, async_op=True, **kwargs)
        work.wait()
        return "async"


def expect_reduced(check, buf, size, count, op, dtype, what):
    is_float = dtype.kind == "f" or dtype.name == "bfloat16"
    expected = closed_form(size, count, op)
    if op is ReduceOp.AVG:
        check.close(buf.astype(np.float64), expected, what, rtol=1e-2 if dtype.itemsize == 2 else 1e-6)
    else:
        if op is ReduceOp.PROD and not is_float:
            expected = expected.astype(np.int64).astype(dtype)  # 2**8 wraps in 8 bits
        check.equal(buf.astype(np.float64), expected.astype(dtype).astype(np.float64), what)


def usable_ops(dtype):
    is_float = dtype.kind == "f" or dtype.name == "bfloat16"
    return [op for op in OPS if op is not ReduceOp.AVG or is_float]


def check_broadcast_and_reduce(check, pg, run, counts, roots):
    rank, size = pg.rank, pg.size
    for algorithm in commlib.algorithms("broadcast") + ["auto"]:
        for dtype in map(np.dtype, DTYPES):
            for count in counts:
                for root in roots:
                    buf = tagged(rank, count, dtype)
                    mode = run(pg.broadcast, buf, root, algorithm=algorithm)
                    check.equal(buf, tagged(root, count, dtype),
                                f"broadcast {algorithm} {dtype} n={count} root={root} {mode}")
    for algorithm in commlib.algorithms("reduce") + ["auto"]:
        for dtype in map(np.dtype, DTYPES):
            for op in usable_ops(dtype):
                for count in counts:
                    for root in roots:
                        buf = rank_values(rank, count, op).astype(dtype)
                        before = buf.copy()
                        mode = run(pg.reduce, buf, root, op, algorithm=algorithm)
                        what = f"reduce {algorithm} {dtype} {op.name} n={count} root={root} {mode}"
                        if rank == root:
                            expect_reduced(check, buf, size, count, op, dtype, what)
                        else:
                            check.check(buf.tobytes() == before.tobytes(), f"{what}: a non-root buffer changed")


def check_allgather_and_reduce_scatter(check, pg, run, blocks):
    rank, size = pg.rank, pg.size
    for algorithm in commlib.algorithms("allgather") + ["auto"]:
        for dtype in map(np.dtype, DTYPES):
            for block in blocks:
                inp = tagged(rank, block, dtype).reshape(-1, 1) if block else tagged(rank, 0, dtype)
                out = np.full(block * size, 99, dtype)
                mode = run(pg.allgather, out, inp, algorithm=algorithm)
                expected = np.concatenate([tagged(r, block, dtype) for r in range(size)])
                check.equal(out, expected, f"allgather {algorithm} {dtype} block={block} {mode}")
    for algorithm in commlib.algorithms("reduce_scatter") + ["auto"]:
        for dtype in map(np.dtype, DTYPES):
            for op in usable_ops(dtype):
                for block in blocks:
                    inp = rank_values(rank, block * size, op).astype(dtype)
                    before = inp.copy()
                    out = np.full(block, 99, dtype)
                    mode = run(pg.reduce_scatter, out, inp, op, algorithm=algorithm)
                    what = f"reduce_scatter {algorithm} {dtype} {op.name} block={block} {mode}"
                    expected = closed_form(size, block * size, op)[rank * block:(rank + 1) * block]
                    if op is ReduceOp.AVG:
                        check.close(out.astype(np.float64), expected, what, rtol=1e-2 if dtype.itemsize == 2 else 1e-6)
                    else:
                        if op is ReduceOp.PROD and dtype.kind in "iu":
                            expected = expected.astype(np.int64).astype(dtype)
                        check.equal(out.astype(np.float64), expected.astype(dtype).astype(np.float64), what)
                    check.check(inp.tobytes() == before.tobytes(), f"{what}: inp changed")


def check_alltoall(check, pg, run, blocks):
    rank, size = pg.rank, pg.size
    for algorithm in commlib.algorithms("alltoall") + ["auto"]:
        for dtype in map(np.dtype, DTYPES):
            for block in blocks:
                inp = np.concatenate([tagged(rank, block, dtype, salt=j) for j in range(size)])
                out = np.full(block * size, 99, dtype)
                mode = run(pg.alltoall, out, inp, algorithm=algorithm)
                expected = np.concatenate([tagged(i, block, dtype, salt=rank) for i in range(size)])
                check.equal(out, expected, f"alltoall {algorithm} {dtype} block={block} {mode}")
    for algorithm in commlib.algorithms("alltoallv") + ["auto"]:
        for dtype in map(np.dtype, DTYPES):
            for pattern in range(3):  # counts[i][j] elements from i to j, zeros included
                counts = [[(i + 2 * j + pattern) % 4 for j in range(size)] for i in range(size)]
                inp = np.concatenate([tagged(rank, counts[rank][j], dtype, salt=j) for j in range(size)])
                out = np.full(sum(counts[i][rank] for i in range(size)), 99, dtype)
                mode = run(pg.alltoallv, out, inp, [counts[i][rank] for i in range(size)], counts[rank],
                           algorithm=algorithm)
                expected = np.concatenate([tagged(i, counts[i][rank], dtype, salt=rank) for i in range(size)])
                check.equal(out, expected, f"alltoallv {algorithm} {dtype} pattern={pattern} {mode}")


def check_gather_scatter_barrier(check, pg, run, blocks, roots):
    rank, size = pg.rank, pg.size
    for algorithm in commlib.algorithms("gather") + ["auto"]:
        for dtype in map(np.dtype, DTYPES):
            for block in blocks:
                for root in roots:
                    out = np.full(block * size, 99, dtype) if rank == root else None
                    mode = run(pg.gather, out, tagged(rank, block, dtype), root, algorithm=algorithm)
                    if rank == root:
                        expected = np.concatenate([tagged(r, block, dtype) for r in range(size)])
                        check.equal(out, expected, f"gather {algorithm} {dtype} block={block} root={root} {mode}")
    for algorithm in commlib.algorithms("scatter") + ["auto"]:
        for dtype in map(np.dtype, DTYPES):
            for block in blocks:
                for root in roots:
                    whole = np.concatenate([tagged(r, block, dtype, salt=root) for r in range(size)])
                    inp = whole.copy() if rank == root else None
                    out = np.full(block, 99, dtype)
                    mode = run(pg.scatter, out, inp, root, algorithm=algorithm)
                    check.equal(out, whole[rank * block:(rank + 1) * block],
                                f"scatter {algorithm} {dtype} block={block} root={root} {mode}")
    for algorithm in commlib.algorithms("barrier") + ["auto"]:
        for _ in range(3):
            mode = run(pg.barrier, algorithm=algorithm)
            check.check(True, f"barrier {algorithm} {mode}")


def check_random_bytes_arrive_intact(check, pg, run):
    """Data movement must be bit-exact for any bytes (NaN payloads too), equal wherever replicated."""
    rank, size = pg.rank, pg.size
    digests, labels = [], []
    for dtype in map(np.dtype, ("float16", "float32", "float64")):
        count = 7 * size + 3
        for algorithm in commlib.algorithms("broadcast"):
            buf = random_bytes(1000 + rank, count, dtype)
            run(pg.broadcast, buf, size - 1, algorithm=algorithm)
            check.check(buf.tobytes() == random_bytes(1000 + size - 1, count, dtype).tobytes(),
                        f"broadcast {algorithm} {dtype}: random bytes changed on the way")
            digests.append(hashlib.sha1(buf.tobytes()).hexdigest())
            labels.append(f"broadcast {algorithm} {dtype}")
        for algorithm in commlib.algorithms("allgather"):
            out = np.empty(count * size, dtype)
            run(pg.allgather, out, random_bytes(2000 + rank, count, dtype), algorithm=algorithm)
            expected = b"".join(random_bytes(2000 + r, count, dtype).tobytes() for r in range(size))
            check.check(out.tobytes() == expected, f"allgather {algorithm} {dtype}: random bytes changed")
            digests.append(hashlib.sha1(out.tobytes()).hexdigest())
            labels.append(f"allgather {algorithm} {dtype}")
        for algorithm in commlib.algorithms("alltoall"):
            inp = random_bytes(3000 + rank, count * size, dtype)
            out = np.empty_like(inp)
            run(pg.alltoall, out, inp, algorithm=algorithm)
            expected = b"".join(random_bytes(3000 + i, count * size, dtype)[rank * count:(rank + 1) * count].tobytes()
                                for i in range(size))
            check.check(out.tobytes() == expected, f"alltoall {algorithm} {dtype}: random bytes changed")
    all_digests = check.comm.allgather(digests)
    for index, label in enumerate(labels):
        differing = [r for r in range(size) if all_digests[r][index] != all_digests[0][index]]
        check.check(not differing, lambda: f"{label}: ranks {differing} hold different bytes than rank 0")


def check_mismatched_alltoallv_counts(check, pg):
    """Rank 0 expects one element too many from the last rank: every rank raises, nothing is sent."""
    rank, size = pg.rank, pg.size
    in_counts = [2] * size
    out_counts = [2] * size
    if rank == 0:
        out_counts[size - 1] = 3
    inp = np.full(sum(in_counts), rank, np.int32)
    out = np.full(sum(out_counts), -1, np.int32)
    error = check.raises(InvalidUsageError, lambda: pg.alltoallv(out, inp, out_counts, in_counts),
                         "alltoallv with mismatched counts",
                         match=f"rank {size - 1} sends 2 to rank 0, which expects 3")
    if rank == 0 and error is not None:
        print(f"mismatched alltoallv counts: {error}", flush=True)
    check.check(np.all(out == -1) and np.all(inp == rank), "alltoallv with mismatched counts wrote a buffer")
    ok = np.empty(2 * size, np.int32)
    pg.alltoallv(ok, inp[:2 * size], [2] * size, [2] * size)  # the group still works
    check.equal(ok, np.repeat(np.arange(size, dtype=np.int32), 2), "alltoallv after a count mismatch")


def main():
    segment_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    pg = commlib.init(timeout=60, segment_bytes=segment_bytes)
    size = pg.size
    check = Checker()
    run = Runner()
    counts = sorted({0, 1, max(size - 1, 1), size, 7 * size + 3})
    roots = sorted({0, size - 1})
    check_broadcast_and_reduce(check, pg, run, counts + [COUNTS_EXTRA], roots)
    check_allgather_and_reduce_scatter(check, pg, run, (0, 1, 3, 37))
    check_alltoall(check, pg, run, (0, 1, 3))
    check_gather_scatter_barrier(check, pg, run, (0, 1, 3), roots)
    check_random_bytes_arrive_intact(check, pg, run)
    check_mismatched_alltoallv_counts(check, pg)
    check.finish()


if __name__ == "__main__":
    main()
