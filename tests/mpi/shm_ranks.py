"""PYTHONPATH=. mpiexec -n P python tests/mpi/shm_ranks.py [off]

The shared-memory collectives under real processes (run with tiny slots and staging halves, so
short inputs take many rounds, see test_shm.py): every dtype x op x odd size for shm_oneshot,
shm_twoshot and auto, on plain buffers, symmetric buffers (``pg.alloc``) and a mix of both
(explicit algorithms); random floats end with the same bytes on every rank; the inline small
path stays in step with the general path, MPI collectives and async work; ``alloc`` agrees,
reuses freed places and refuses what cannot be; no segment file is left in /dev/shm.
The data movers' ``shm_direct`` (broadcast, allgather, gather, scatter, alltoall): random bytes of
odd sizes from plain, symmetric and mixed sources, every root, arrive bit for bit; a symmetric
source rewritten right after each call never reaches a peer. Peers' heaps are writable (the
two-shot pushes into them), the rest of their segments is not.
``off`` (run with COMMLIB_SHM=0): no shared memory, and the shm_* algorithms and ``alloc`` say so.
"""

import glob
import hashlib
import os
import sys

import numpy as np

import commlib
from commlib import InvalidUsageError, ReduceOp
from commlib.shm.segments import shared_directory
from tests.support.fast_path_checks import wait_for_empty_line
from tests.support.closed_form import DTYPES, OPS, closed_form, random_bytes, rank_values
from tests.support.verdict import Checker

ALGORITHMS = ["shm_oneshot", "shm_twoshot", "auto"]


def check_shared_memory_off(pg, check):
    check.check(pg.host_memory is None and not pg.prefers_symmetric_buffers, "COMMLIB_SHM=0: no shared memory")
    check.raises(InvalidUsageError, lambda: pg.alloc(4), "alloc without shared memory", match="COMMLIB_SHM=0")
    for name in ("shm_oneshot", "shm_twoshot"):
        buf = np.arange(5.0)
        check.raises(InvalidUsageError, lambda: pg.allreduce(buf, algorithm=name), f"{name} without shared memory",
                     match="COMMLIB_SHM=0")
        check.equal(buf, np.arange(5.0), f"{name} refused before touching the buffer")
    for nbytes in (8, 1 << 20, 64 << 20):
        check.check(not pg.resolve_algorithm("auto", nbytes).startswith("shm_"), "auto stays on MPI")
    buf = np.full(1000, pg.rank + 1.0)
    pg.allreduce(buf)
    check.equal(buf, np.full(1000, pg.size * (pg.size + 1) / 2), "auto allreduce without shared memory")
    check.finish()


def check_data_movers(pg, check):
    """shm_direct and auto for each data mover x plain / symmetric / mixed (symmetric on even
    ranks) sources x odd sizes (staging halves of 1 KiB: several rounds) x every root."""
    rank, size = pg.rank, pg.size
    calls = 0
    for dtype in (np.dtype(np.uint8), np.dtype(np.float32), np.dtype(np.int64)):
        for count in sorted({0, 1, size + 1, 301, 1201}):
            for kind in ("plain", "symmetric", "mixed"):
                def source(n, seed):
                    # Collective: every rank allocates (pg.alloc), only some use it.
                    shared = pg.alloc(n, dtype)
                    array = shared if kind == "symmetric" or (kind == "mixed" and rank % 2 == 0) else np.empty(n, dtype)
                    array[...] = random_bytes(seed, n, dtype)
                    return array

                blocks = [random_bytes(1000 * r + count, count, dtype) for r in range(size)]
                label = f"{dtype} n={count} {kind}"
                for algorithm in ("shm_direct", "auto"):
                    inp = source(count, 1000 * rank + count)
                    out = np.empty(count * size, dtype)
                    pg.allgather(out, inp, algorithm=algorithm)
                    check.equal(out.view(np.uint8), np.concatenate(blocks).view(np.uint8), f"allgather {label}")
                    matrices = [random_bytes(7000 + 100 * r + count, count * size, dtype) for r in range(size)]
                    inp = source(count * size, 7000 + 100 * rank + count)
                    pg.alltoall(out, inp, algorithm=algorithm)
                    expected = np.concatenate([m[rank * count:(rank + 1) * count] for m in matrices])
                    check.equal(out.view(np.uint8), expected.view(np.uint8), f"alltoall {label}")
                    calls += 2
                    for root in range(size):
                        buf = source(count, 1000 * rank + count)
                        pg.broadcast(buf, root, algorithm=algorithm)
                        check.equal(buf.view(np.uint8), blocks[root].view(np.uint8), f"broadcast {label} root {root}")
                        inp = source(count, 1000 * rank + count)
                        gathered = np.empty(count * size, dtype) if rank == root else None
                        pg.gather(gathered, inp, root, algorithm=algorithm)
                        if rank == root:
                            check.equal(gathered.view(np.uint8), np.concatenate(blocks).view(np.uint8),
                                        f"gather {label} root {root}")
                        whole = source(count * size, 7000 + 100 * root + count)
                        part = np.empty(count, dtype)
                        pg.scatter(part, whole if rank == root else None, root, algorithm=algorithm)
                        mine = matrices[root][rank * count:(rank + 1) * count]
                        check.equal(part.view(np.uint8), mine.view(np.uint8), f"scatter {label} root {root}")
                        calls += 3
    # auto picks shm_direct for a large broadcast and allgather at 4 and 8 ranks (by size: the same
    # on every rank).
    big = random_bytes(5, 600 << 10, np.dtype(np.uint8))
    chosen = pg.resolve_algorithm("auto", big.nbytes, collective="broadcast")
    check.check((chosen == "shm_direct") == (size in (4, 8)), f"auto broadcast of 600 KiB at P={size}: {chosen}")
    for root in range(size):
        buf = big.copy() if rank == root else np.zeros_like(big)
        pg.broadcast(buf, root)
        check.equal(buf, big, f"auto broadcast of 600 KiB from {root} ({chosen})")
    # Two ranks that can copy from each other's memory split a broadcast's copy from 1 MiB on
    # (COMMLIB_SHM_CMA=0 turns that off; elsewhere the group's probe decides, the same everywhere).
    cross_memory = pg.prefers_symmetric_buffers and pg.host_memory.transport.cross_memory is not None
    if os.environ.get("COMMLIB_SHM_CMA") == "0":
        check.check(not cross_memory, "COMMLIB_SHM_CMA=0: no cross-memory copies")
    huge = random_bytes(8, (3 << 20) + 5, np.dtype(np.uint8))
    chosen = pg.resolve_algorithm("auto", huge.nbytes, collective="broadcast")
    check.check((chosen == "shm_direct") == (size in (4, 8) or (size == 2 and cross_memory)),
                f"auto broadcast of 3 MiB at P={size} (cross-memory {cross_memory}): {chosen}")
    for collective in ("scatter", "gather"):
        chosen = pg.resolve_algorithm("auto", 8 << 20, collective=collective)
        check.check((chosen == "shm_direct") == (size in (4, 8) or (size == 2 and cross_memory)),
                    f"auto {collective} of 8 MiB at P={size} (cross-memory {cross_memory}): {chosen}")
    for kind in ("plain", "symmetric"):
        for root in range(size):
            buf = pg.alloc(huge.size, np.uint8) if kind == "symmetric" else np.empty(huge.size, np.uint8)
            buf[...] = huge if rank == root else 0
            pg.broadcast(buf, root, algorithm="shm_direct")
            check.equal(buf, huge, f"shm_direct broadcast of 3 MiB, {kind}, from {root}")
            del buf
            # scatter and gather of 3 MiB in all (at P=2 split like the broadcast)
            whole = pg.alloc(huge.size - huge.size % size, np.uint8) if kind == "symmetric" else \
                np.empty(huge.size - huge.size % size, np.uint8)
            whole[...] = huge[:whole.size]
            part = np.empty(whole.size // size, np.uint8)
            pg.scatter(part, whole if rank == root else None, root, algorithm="shm_direct")
            check.equal(part, huge[rank * part.size:(rank + 1) * part.size], f"shm_direct scatter, {kind}, from {root}")
            gathered = np.empty(whole.size, np.uint8) if rank == root else None
            pg.gather(gathered, whole[rank * part.size:(rank + 1) * part.size], root, algorithm="shm_direct")
            if rank == root:
                check.equal(gathered, huge[:whole.size], f"shm_direct gather, {kind}, to {root}")
            del whole
    block = random_bytes(6 + rank, (600 << 10) // size, np.dtype(np.uint8))
    gathered = np.empty(block.size * size, np.uint8)
    chosen = pg.resolve_algorithm("auto", gathered.nbytes, collective="allgather")
    check.check((chosen == "shm_direct") == (size in (4, 8)), f"auto allgather of 600 KiB at P={size}: {chosen}")
    pg.allgather(gathered, block)
    expected = np.concatenate([random_bytes(6 + r, block.size, np.dtype(np.uint8)) for r in range(size)])
    check.equal(gathered, expected, f"auto allgather of 600 KiB ({chosen})")
    # A symmetric source may be written as soon as the call returns: no peer may still read it.
    buf = pg.alloc(3001, np.int32)
    out = np.empty(3001 * size, np.int32)
    for step in range(20):
        buf[...] = rank * 100 + step
        pg.allgather(out, buf, algorithm="shm_direct")
        buf[...] = -1  # would show up in a peer's out had it still been reading
        check.equal(out, np.repeat(np.arange(size) * 100 + step, 3001), f"symmetric source rewritten #{step}")
    # Every buffer symmetric: the allgather pushes each block into every rank's output; a rank's
    # output is complete when the call returns, and no peer writes it afterwards.
    sym_out = pg.alloc(3001 * size, np.int32)
    matrix = pg.alloc(3001 * size, np.int32)
    for step in range(20):
        buf[...] = rank * 100 + step
        pg.allgather(sym_out, buf, algorithm="shm_direct")
        check.equal(sym_out, np.repeat(np.arange(size) * 100 + step, 3001), f"allgather, all symmetric, #{step}")
        sym_out[...] = -1
        matrix[...] = np.repeat(np.arange(size) + 10 * rank + step, 3001)
        pg.alltoall(sym_out, matrix, algorithm="shm_direct")
        check.equal(sym_out, np.repeat(10 * np.arange(size) + rank + step, 3001), f"alltoall, all symmetric, #{step}")
        sym_out[...] = -1
    # auto with every buffer symmetric: shm_direct for allgather and alltoall from 512 KiB at 2, 4
    # and 8 ranks (the library's copies from shared pages are slower); with one plain buffer the
    # size alone decides, as for plain ones (allgathers of 512 KiB-4 MiB at 4 and 8 ranks).
    block = (1 << 20) // (4 * size) + 1
    sym_inp, plain_out = pg.alloc(block * size, np.int32), np.empty(block * size, np.int32)
    sym_out = pg.alloc(block * size, np.int32)
    for collective in ("allgather", "alltoall"):
        for output_kind, out in (("symmetric", sym_out), ("plain", plain_out)):
            inp = sym_inp[:block] if collective == "allgather" else sym_inp
            inp[...] = np.arange(inp.size) + 1000 * rank
            getattr(pg, collective)(out, inp)
            if collective == "allgather":
                expected = np.concatenate([np.arange(block) + 1000 * r for r in range(size)])
            else:
                expected = np.concatenate([np.arange(rank * block, (rank + 1) * block) + 1000 * r for r in range(size)])
            ran = pg.transport.context.algorithm
            label = f"auto {collective} of {out.nbytes} B, symmetric source, {output_kind} output, P={size}"
            check.equal(out, expected, label)
            wanted = size in (2, 4, 8) if output_kind == "symmetric" else (collective == "allgather" and size in (4, 8))
            check.check((ran == "shm_direct") == wanted, f"{label}: ran {ran}")
    check.check(calls > 0, "the data movers ran")


def main():
    pg = commlib.init(timeout=60, segment_bytes=64)
    if sys.argv[1:] == ["off"]:
        return check_shared_memory_off(pg, Checker())
    rank, size = pg.rank, pg.size
    check = Checker()

    # Segment files exist only while the ranks map them: by now nothing is left to clean up.
    pids = check.comm.allgather(os.getpid())
    left = [path for pid in pids for path in glob.glob(os.path.join(shared_directory(), f"commlib-*-{pid}-*"))]
    check.check(not left, f"segment files left in {shared_directory()} after init: {left}")
    check.check(pg.host_memory is not None and pg.host_memory.single_host, "one host, shared memory set up")
    # shm_twoshot pushes into the peers' symmetric buffers: their heaps are writable here, and
    # nothing else of their segments (a stray write is an error, not a peer's corrupted counter).
    transport = pg.host_memory.transport
    check.check(transport.peers_writable, "the peers' heaps are mapped writable")
    heap_start = transport.layout.heap_start
    for peer in range(size):
        if peer != rank:
            check.raises(ValueError, lambda: transport.peer_bytes(peer, 0, 8).fill(1),
                         f"rank {peer}'s control page is read-only here", match="read-only")
            offsets = [heap_start] * size
            offsets[peer] = heap_start - 8
            check.raises(commlib.CommError, lambda: transport.writable_arrays(offsets, 1, np.dtype(np.int64)),
                         f"rank {peer}'s segment below its heap is not writable", match="cannot write")

    counts = sorted({0, 1, max(size - 1, 1), size, 7 * size + 3, 301})
    for algorithm in ALGORITHMS:
        for dtype in DTYPES:
            dtype = np.dtype(dtype)
            is_float = dtype.kind == "f" or dtype.name == "bfloat16"
            for op in OPS:
                if op is ReduceOp.AVG and not is_float:
                    continue  # refused by validation (collectives_ranks.py)
                if op is ReduceOp.PROD and dtype.itemsize == 1 and size > 4:
                    continue  # 2**8 wraps in 8 bits; the wrap itself is not under test
                for count in counts:
                    kinds = ("plain", "symmetric") + (("mixed",) if algorithm != "auto" else ())
                    for kind in kinds:
                        symmetric = pg.alloc(count, dtype)
                        use_symmetric = kind == "symmetric" or (kind == "mixed" and rank % 2 == 0)
                        buf = symmetric if use_symmetric else np.empty(count, dtype)
                        buf[...] = rank_values(rank, count, op).astype(dtype)
                        pg.allreduce(buf, op, algorithm=algorithm)
                        expected = closed_form(size, count, op)
                        what = f"{algorithm} {dtype} {op.name} n={count} {kind}"
                        if op is ReduceOp.AVG:
                            check.close(buf.astype(np.float64), expected, what,
                                        rtol=1e-2 if dtype.itemsize == 2 else 1e-6)
                        else:
                            if not is_float:
                                expected = expected.astype(np.int64).astype(dtype)
                            check.equal(buf.astype(np.float64), expected.astype(dtype).astype(np.float64), what)

    # Random floats: the order of the sums matters, so the same bytes everywhere is a property.
    rng = np.random.default_rng(1234 + rank)
    digests, labels = [], []
    for algorithm in ALGORITHMS:
        for dtype in ("float16", "float32", "float64"):
            for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG):
                for count in (size + 1, 5001):
                    for symmetric in (False, True):
                        buf = pg.alloc(count, dtype) if symmetric else np.empty(count, dtype)
                        buf[...] = rng.uniform(0.5, 1.5, count).astype(dtype)
                        pg.allreduce(buf, op, algorithm=algorithm)
                        digests.append(hashlib.sha1(buf.tobytes()).hexdigest())
                        labels.append(f"{algorithm} {dtype} {op.name} n={count} symmetric={symmetric}")
    all_digests = check.comm.allgather(digests)
    for index, label in enumerate(labels):
        differing = [r for r in range(size) if all_digests[r][index] != all_digests[0][index]]
        check.check(not differing, lambda: f"{label}: ranks {differing} hold different bytes than rank 0")

    # The inline 8-byte path keeps its place among everything else the group runs.
    small = np.zeros(2, np.float32)
    vector = pg.alloc(1000, np.int64)
    for step in range(200):
        small[:] = (rank + step, 1)
        pg.allreduce(small)
        check.equal(small, np.array([sum(range(size)) + size * step, size], np.float32), f"small #{step}")
        if step % 7 == 0:
            vector[:] = rank + step
            work = pg.allreduce(vector, ReduceOp.MAX, async_op=True)
            pg.allreduce(small)  # queued behind the async one: takes the general path
            work.wait()
            check.equal(vector, np.full(1000, size - 1 + step), f"async MAX #{step}")
        if step % 11 == 0:
            root = step % size
            token = np.array([rank], np.int64)
            pg.broadcast(token, root=root)
            check.equal(token, np.array([root]), f"broadcast #{step}")
            pg.allreduce(small, algorithm="native")

    # The fast path keys the slots' views by shape, dtype and op: switch between kinds, N-d ones
    # included, on both sides of the 48 bytes that ride on the signal's cache line.
    kinds = [((2, 3), np.float32), ((12,), np.float32), ((14,), np.float32), ((3, 2, 2), np.int8),
             ((6,), np.float64), ((7,), np.float64)]
    wait_for_empty_line(pg.executor)  # the async allreduces above are counted off the line
    runs_before = pg.executor.inline_runs
    for step in range(42):
        shape, dtype = kinds[step % len(kinds)]
        op = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN)[step % 3]
        value = step % 5
        array = np.full(shape, rank + value, dtype)
        pg.allreduce(array, op)
        expected = {ReduceOp.SUM: size * value + size * (size - 1) // 2, ReduceOp.MAX: size - 1 + value,
                    ReduceOp.MIN: value}[op]
        check.equal(array, np.full(shape, expected, dtype), f"fast path {shape} {np.dtype(dtype)} {op.name}")
    if size > 1:
        check.check(pg.executor.inline_runs - runs_before == 42,
                    lambda: f"{pg.executor.inline_runs - runs_before} of 42 small allreduces ran inline")

    # alloc: every rank must ask for the same; a freed place comes back once all dropped it.
    if size > 1:
        bad = (7,) if rank == size - 1 else (5,)
        check.raises(InvalidUsageError, lambda: pg.alloc(bad, np.float32), "alloc of different shapes",
                     match="must ask for the same bytes")
    first = pg.alloc(3000, np.float64)
    offset = pg.host_memory.transport.locate(first)
    del first
    second = pg.alloc(3000, np.float64)
    check.check(pg.host_memory.transport.locate(second) == offset,
                "a place freed on every rank is reused by the next alloc")
    check.check(pg.alloc(0, np.float32).size == 0, "alloc of 0 elements")
    check.raises(InvalidUsageError, lambda: pg.alloc(1 << 40, np.uint8), "alloc beyond the heap",
                 match="do not fit in the symmetric heap")
    check.raises(InvalidUsageError, lambda: pg.alloc(4, object), "alloc of an object dtype",
                 match="unsupported dtype")
    check.raises(InvalidUsageError, lambda: pg.alloc((2, -1), np.float32), "alloc of a negative shape",
                 match="negative")
    check_data_movers(pg, check)
    pg.barrier()
    check.finish()


if __name__ == "__main__":
    main()
