"""PYTHONPATH=. mpiexec -n P python tests/mpi/collectives_allreduce_ranks.py [segment_bytes [ALGORITHM,ALGORITHM...]]

Every allreduce schedule (ring, tree, recursive_doubling, rabenseifner) through the public
``pg.allreduce(..., algorithm=name)``, with a tiny ``segment_bytes`` so the pipelined paths run:
dtypes x ops x odd sizes (0, 1, < P, P, not divisible by P) against a closed form (exact: the
inputs are small integers), then random floats whose bytes must be identical on every rank.
"""

import hashlib
import sys

import numpy as np

import commlib
from commlib import ReduceOp
from tests.support.closed_form import DTYPES, OPS, closed_form, rank_values
from tests.support.verdict import Checker

ALGORITHMS = ["ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical"]


def main():
    segment_bytes = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    algorithms = sys.argv[2].split(",") if len(sys.argv) > 2 else ALGORITHMS
    pg = commlib.init(timeout=60, segment_bytes=segment_bytes)
    rank, size = pg.rank, pg.size
    check = Checker()
    counts = sorted({0, 1, max(size - 1, 1), size, 7 * size + 3})
    for algorithm in algorithms:
        for dtype in DTYPES:
            dtype = np.dtype(dtype)
            is_float = dtype.kind == "f" or dtype.name == "bfloat16"
            for op in OPS:
                if op is ReduceOp.AVG and not is_float:
                    continue  # refused by validation; covered by collectives_ranks.py
                # One longer input per algorithm and op: many segments in every chunk.
                for count in counts + ([301] if dtype.name in ("float32", "int8") else []):
                    buf = rank_values(rank, count, op).astype(dtype)
                    pg.allreduce(buf, op, algorithm=algorithm)
                    expected = closed_form(size, count, op)
                    if op is ReduceOp.PROD and not is_float:
                        expected = expected.astype(np.int64).astype(dtype)  # 2**8 wraps in 8 bits
                    what = f"{algorithm} {dtype} {op.name} n={count} seg={segment_bytes}"
                    if op is ReduceOp.AVG:  # the one division may round
                        check.close(buf.astype(np.float64), expected, what, rtol=1e-2 if dtype.itemsize == 2 else 1e-6)
                    else:
                        check.equal(buf.astype(np.float64), expected.astype(dtype).astype(np.float64), what)

    # Random floats: summation order matters, so equal bytes on every rank is a real property.
    rng = np.random.default_rng(1234 + rank)
    digests, labels = [], []
    for algorithm in algorithms:
        for dtype in ("float16", "float32", "float64"):
            for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG):
                for count in (size + 1, 501):
                    buf = rng.uniform(0.5, 1.5, count).astype(dtype)
                    pg.allreduce(buf, op, algorithm=algorithm)
                    digests.append(hashlib.sha1(buf.tobytes()).hexdigest())
                    labels.append(f"{algorithm} {dtype} {op.name} n={count}")
    all_digests = check.comm.allgather(digests)
    for index, label in enumerate(labels):
        differing = [r for r in range(size) if all_digests[r][index] != all_digests[0][index]]
        check.check(not differing, lambda: f"{label}: ranks {differing} hold different bytes than rank 0")
    check.finish()


if __name__ == "__main__":
    main()
