# mpiexec -n 4 python mpi_examples/write_your_own_algorithm.py [commlib.bench flags, e.g. -b 1K -e 4M -n 20]
"""A new allreduce in 30 lines: write it against the transport, register it, check it, time it.

``direct`` is the one-shot algorithm: a reduce-scatter in which every rank sends each peer that
peer's chunk at once, then an allgather in which every owner sends its reduced chunk to all.

* chunk: the ``n/p`` elements rank ``r`` owns (``split_bounds``); the owner alone reduces it,
  so every rank ends with the same bytes;
* cost (alpha-beta): 2 steps of ``p-1`` concurrent messages of ``n/p`` each, ``2(alpha +
  (p-1) n/p beta)`` when a rank's link carries its messages one after another: the ring's
  bytes with 2 latencies instead of ``2(p-1)``. It wins for small messages and small ``p``;
  for large ``p`` every rank receives from all others at once (incast) and the ring wins;
* scratch: ``(p-1) n/p`` elements, one slot per peer.
"""

import sys

import numpy as np

import commlib
from commlib.algorithms.common.partition import split_bounds
from commlib.bench import harness as bench


def allreduce_direct(transport, buf, op, *, segment_bytes):
    size, rank = transport.size, transport.rank
    if size == 1 or buf.size == 0:
        return
    chunks = split_bounds(0, buf.size, size)
    lo, hi = chunks[rank]
    peers = [peer for peer in range(size) if peer != rank]
    incoming = transport.scratch(len(peers) * (hi - lo), buf.dtype)
    slots = [incoming[i * (hi - lo):(i + 1) * (hi - lo)] for i in range(len(peers))]

    transport.step("direct reduce-scatter")
    sends = [(buf[chunks[p][0]:chunks[p][1]], p) for p in peers if chunks[p][1] > chunks[p][0]]
    recvs = [(slot, p) for slot, p in zip(slots, peers)] if hi > lo else []
    transport.exchange(sends, recvs)
    for slot in slots if hi > lo else []:
        transport.reduce(buf[lo:hi], slot, op)

    transport.step("direct allgather")
    sends = [(buf[lo:hi], p) for p in peers] if hi > lo else []
    recvs = [(buf[chunks[p][0]:chunks[p][1]], p) for p in peers if chunks[p][1] > chunks[p][0]]
    transport.exchange(sends, recvs)


def check(pg, counts):
    """The library's path with algorithm="direct" against its native allreduce; returns #failures."""
    failures = 0
    rng = np.random.default_rng(1234 + pg.rank)
    for count in counts:
        for dtype, op in ((np.int64, commlib.ReduceOp.SUM), (np.float32, commlib.ReduceOp.SUM),
                          (np.float64, commlib.ReduceOp.AVG), (np.float32, commlib.ReduceOp.MAX)):
            data = (rng.integers(-1000, 1000, count) if dtype is np.int64 else rng.standard_normal(count)).astype(dtype)
            ours, reference = data.copy(), data.copy()
            pg.allreduce(ours, op, algorithm="direct")
            pg.allreduce(reference, op, algorithm="native")
            exact = dtype is np.int64 or op is commlib.ReduceOp.MAX
            ok = np.array_equal(ours, reference) if exact else np.allclose(ours, reference, rtol=1e-5, atol=1e-6)
            if not ok:
                failures += 1
                print(f"rank {pg.rank}: direct {op.name} {np.dtype(dtype).name} x{count} differs from native")
    total = np.array([failures], dtype=np.int64)
    pg.allreduce(total, algorithm="native")
    return int(total[0])


def main(bench_flags):
    commlib.register_algorithm("direct", allreduce_direct)
    pg = commlib.init()
    # Sizes below, at and just above the world size catch chunk-boundary mistakes.
    counts = [0, 1, pg.size - 1, pg.size, pg.size + 1, 1000, 4099]
    failures = check(pg, counts)
    if pg.rank == 0:
        print(f"direct vs native on {pg.size} ranks, {len(counts)} sizes x 4 (dtype, op): "
              f"{'all equal' if not failures else f'{failures} MISMATCHES'}")
    if failures:
        return 1
    # The library's benchmark (python -m commlib.bench) knows the new name now: time it against
    # MPI_Allreduce and the built-in schedules; later flags override these defaults.
    return bench.main(["-b", "1K", "-e", "1M", "-f", "32", "-n", "10", "-a", "native,ring,direct", *bench_flags])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
