# mpiexec -n 4 python mpi_examples/allreduce_algorithms.py [--sizes 1K,64K,1M] [--iters 20]
"""Every registered allreduce algorithm on a few message sizes: is it right, and how fast?

Each rank contributes ``rank + i mod 4096`` at index ``i``: small integers, so every partial sum
is exact in float32 whatever the order and the result has a closed form, ``P*(i mod 4096) +
P(P-1)/2``. A wrong element anywhere is counted on every rank. Times are medians over
``--iters`` runs after one warm-up, measured between barriers.
"""

import argparse
import statistics
import sys
import time

import numpy as np

import commlib


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def run_one(pg, algorithm, count, iters):
    """(median seconds, number of wrong elements summed over ranks) for one algorithm and size."""
    pattern = np.arange(count) % 4096
    expected = pg.size * pattern + pg.size * (pg.size - 1) / 2
    contribution = (pattern + pg.rank).astype(np.float32)
    buf = np.empty_like(contribution)
    times, wrong = [], 0
    for index in range(iters + 1):
        buf[...] = contribution
        pg.barrier()
        start = time.perf_counter()
        pg.allreduce(buf, algorithm=algorithm)
        elapsed = time.perf_counter() - start
        if index:  # the first run is the warm-up
            times.append(elapsed)
        wrong += int(np.count_nonzero(buf != expected))
    # Every rank reports the slowest rank's time: that is when the collective was done everywhere.
    slowest = np.array([statistics.median(times)])
    pg.allreduce(slowest, commlib.ReduceOp.MAX, algorithm="native")
    total_wrong = np.array([wrong], dtype=np.int64)
    pg.allreduce(total_wrong, algorithm="native")
    return float(slowest[0]), int(total_wrong[0])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4K,256K,4M", help="message sizes in bytes (K, M suffixes)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--algorithms", default=",".join(commlib.algorithms()),
                        help="comma-separated (default: all registered)")
    args = parser.parse_args()
    pg = commlib.init()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    names = args.algorithms.split(",")
    if pg.rank == 0:
        print(f"allreduce, float32 sum, {pg.size} ranks, median of {args.iters}\n")
        print(f"{'algorithm':<20} {'bytes':>10} {'time (us)':>10} {'algbw GB/s':>11} {'busbw GB/s':>11} {'#wrong':>7}")
    failures = 0
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        for name in names:
            seconds, wrong = run_one(pg, name, count, args.iters)
            failures += wrong > 0
            algbw = count * 4 / seconds / 1e9
            # A ring-shaped allreduce moves 2(P-1)/P of the buffer through each link (nccl-tests' busbw).
            busbw = algbw * 2 * (pg.size - 1) / pg.size
            if pg.rank == 0:
                print(f"{name:<20} {count * 4:>10} {seconds * 1e6:>10.1f} {algbw:>11.3f} {busbw:>11.3f} {wrong:>7}")
    if pg.rank == 0:
        print("\nall results correct" if not failures else f"\n{failures} (algorithm, size) pairs WRONG")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
