"""Every algorithm of every collective on the in-process transport, world sizes 1..8.

Every rank is a thread (commlib/transports/inprocess.py), which also records each send, so this
file checks results against closed forms over dtypes x ops x odd sizes x roots (world sizes 5..7
run only here; tests/mpi/collectives_algorithms_ranks.py runs the same matrix under mpiexec at 1,
2, 3, 4 and 8), and the shape of each schedule: who talks to whom, in how many rounds, how many
bytes.
"""

import math
import threading
import time
from collections import Counter, defaultdict

import numpy as np
import pytest

from commlib import ReduceOp
from commlib.algorithms.common.binomial import binomial_parent, relative_rank
from commlib.algorithms.registry import algorithm_names, get_algorithm
from commlib.transports.inprocess import InProcessWorld
from tests.support.closed_form import DTYPE_NAMES, EXACT_OPS, closed_form, dtype_of, rank_values

DTYPES = [*DTYPE_NAMES, "uint16"]  # uint16 too: the one unsigned type wider than a byte
OPS = EXACT_OPS
WORLD = range(1, 9)
SEGMENTS = (8, 1 << 20)  # many segments per message, and one


def tagged(rank, count, dtype, salt=0):
    """Values that say who made them (data-movement collectives compare bytes)."""
    return ((np.arange(count) * 7 + rank * 31 + salt * 5) % 97).astype(dtype)


def roots_for(size):
    return sorted({0, size - 1, size // 2})


def raw(array):
    return array.reshape(-1).view(np.uint8)


class Matrix:
    """Cases for one (collective, algorithm, world size): built per rank, run in one world, checked."""

    def __init__(self, size):
        self.size = size
        self.cases = []  # (label, per-rank call, per-rank check)

    def add(self, label, call, check):
        self.cases.append((label, call, check))

    def run(self, fn, collective, name):
        def every_case(transport):  # one thread per rank for the whole matrix: threads are slow to start
            for _, call, _ in self.cases:
                call(fn, transport, transport.rank)

        InProcessWorld(self.size, timeout=30).run(every_case, collective=collective, algorithm=name)
        for label, _, check in self.cases:
            for rank in range(self.size):
                problem = check(rank)
                assert problem is None, f"{collective} {name} p={self.size} {label} rank {rank}: {problem}"


def mismatch(actual, expected):
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return f"shape {actual.shape}, expected {expected.shape}"
    bad = np.flatnonzero(raw(np.ascontiguousarray(actual)) != raw(np.ascontiguousarray(expected)))
    if bad.size == 0:
        return None
    index = bad[0] // actual.itemsize
    return f"index {index}: got {actual.reshape(-1)[index]!r}, expected {expected.reshape(-1)[index]!r}"


def broadcast_matrix(matrix, size):
    for dtype_name in DTYPES:
        dtype = dtype_of(dtype_name)
        for count in sorted({0, 1, max(size - 1, 1), size, 7 * size + 3}):
            for root in roots_for(size):
                for segment_bytes in SEGMENTS:
                    bufs = [tagged(rank, count, dtype) for rank in range(size)]
                    sent = bufs[root].copy()
                    matrix.add(f"{dtype_name} n={count} root={root} seg={segment_bytes}",
                               lambda fn, t, r, bufs=bufs, root=root, s=segment_bytes: fn(
                                   t, bufs[r], root, segment_bytes=s),
                               lambda r, bufs=bufs, sent=sent: mismatch(bufs[r], sent))


def reduce_matrix(matrix, size):
    for dtype_name in DTYPES:
        dtype = dtype_of(dtype_name)
        for op in OPS:
            for count in sorted({0, 1, max(size - 1, 1), size, 7 * size + 3}):
                for root in roots_for(size):
                    for segment_bytes in SEGMENTS:
                        bufs = [rank_values(rank, count, op).astype(dtype) for rank in range(size)]
                        before = [buf.copy() for buf in bufs]
                        expected = closed_form(size, count, op, dtype)
                        matrix.add(f"{dtype_name} {op.name} n={count} root={root} seg={segment_bytes}",
                                   lambda fn, t, r, bufs=bufs, root=root, op=op, s=segment_bytes:
                                   fn(t, bufs[r], root, op, segment_bytes=s),
                                   lambda r, bufs=bufs, root=root, before=before, expected=expected:
                                   mismatch(bufs[r], expected if r == root else before[r]))


def allgather_matrix(matrix, size):
    for dtype_name in DTYPES:
        dtype = dtype_of(dtype_name)
        for block in (0, 1, 2, 5):
            inps = [tagged(rank, block, dtype) for rank in range(size)]
            outs = [np.full(block * size, 99, dtype) for _ in range(size)]
            expected = np.concatenate(inps)
            before = [inp.copy() for inp in inps]
            matrix.add(f"{dtype_name} block={block}",
                       lambda fn, t, r, outs=outs, inps=inps: fn(t, outs[r], inps[r], segment_bytes=8),
                       lambda r, outs=outs, inps=inps, before=before, expected=expected:
                       mismatch(outs[r], expected) or mismatch(inps[r], before[r]))


def reduce_scatter_matrix(matrix, size):
    for dtype_name in DTYPES:
        dtype = dtype_of(dtype_name)
        for op in OPS:
            for block in (0, 1, 3):
                for segment_bytes in SEGMENTS:
                    inps = [rank_values(rank, block * size, op).astype(dtype) for rank in range(size)]
                    before = [inp.copy() for inp in inps]
                    outs = [np.full(block, 99, dtype) for _ in range(size)]
                    expected = closed_form(size, block * size, op, dtype)
                    matrix.add(f"{dtype_name} {op.name} block={block} seg={segment_bytes}",
                               lambda fn, t, r, outs=outs, inps=inps, op=op, s=segment_bytes:
                               fn(t, outs[r], inps[r], op, segment_bytes=s),
                               lambda r, outs=outs, inps=inps, before=before, expected=expected, block=block:
                               mismatch(outs[r], expected[r * block:(r + 1) * block]) or mismatch(inps[r], before[r]))


def alltoall_blocks(size, block, dtype):
    """inps[i] = blocks (i -> j) for j in rank order; block (i -> j) is tagged(i, block, salt=j)."""
    return [np.concatenate([tagged(i, block, dtype, salt=j) for j in range(size)]) for i in range(size)]


def alltoall_matrix(matrix, size):
    for dtype_name in DTYPES:
        dtype = dtype_of(dtype_name)
        for block in (0, 1, 3):
            inps = alltoall_blocks(size, block, dtype)
            before = [inp.copy() for inp in inps]
            outs = [np.full(block * size, 99, dtype) for _ in range(size)]
            matrix.add(f"{dtype_name} block={block}",
                       lambda fn, t, r, outs=outs, inps=inps: fn(t, outs[r], inps[r], segment_bytes=8),
                       lambda r, outs=outs, inps=inps, before=before, block=block: mismatch(
                           outs[r], np.concatenate([tagged(i, block, outs[r].dtype, salt=r) for i in range(size)]))
                       or mismatch(inps[r], before[r]))


def alltoallv_counts(size, pattern):
    """counts[i][j]: elements rank i sends rank j (zeros included)."""
    return [[(i + 2 * j + pattern) % 4 for j in range(size)] for i in range(size)]


def alltoallv_matrix(matrix, size):
    for dtype_name in DTYPES:
        dtype = dtype_of(dtype_name)
        for pattern in range(3):
            counts = alltoallv_counts(size, pattern)
            inps = [np.concatenate([tagged(i, counts[i][j], dtype, salt=j) for j in range(size)]
                                   or [np.empty(0, dtype)])
                    for i in range(size)]
            outs = [np.full(sum(counts[i][j] for i in range(size)), 99, dtype) for j in range(size)]
            expected = [np.concatenate([tagged(i, counts[i][j], dtype, salt=j) for i in range(size)])
                        for j in range(size)]
            matrix.add(f"{dtype_name} pattern={pattern}",
                       lambda fn, t, r, outs=outs, inps=inps, counts=counts: fn(
                           t, outs[r], inps[r], tuple(counts[i][r] for i in range(size)), tuple(counts[r]),
                           segment_bytes=8),
                       lambda r, outs=outs, expected=expected: mismatch(outs[r], expected[r]))


def gather_matrix(matrix, size):
    for dtype_name in DTYPES:
        dtype = dtype_of(dtype_name)
        for block in (0, 1, 3):
            for root in roots_for(size):
                inps = [tagged(rank, block, dtype) for rank in range(size)]
                outs = [np.full(block * size, 99, dtype) if rank == root else None for rank in range(size)]
                expected = np.concatenate(inps)
                matrix.add(f"{dtype_name} block={block} root={root}",
                           lambda fn, t, r, outs=outs, inps=inps, root=root: fn(
                               t, outs[r], inps[r], root, segment_bytes=8),
                           lambda r, outs=outs, root=root, expected=expected:
                           mismatch(outs[r], expected) if r == root else None)


def scatter_matrix(matrix, size):
    for dtype_name in DTYPES:
        dtype = dtype_of(dtype_name)
        for block in (0, 1, 3):
            for root in roots_for(size):
                source = np.concatenate([tagged(rank, block, dtype, salt=root) for rank in range(size)])
                inps = [source.copy() if rank == root else None for rank in range(size)]
                outs = [np.full(block, 99, dtype) for _ in range(size)]
                matrix.add(f"{dtype_name} block={block} root={root}",
                           lambda fn, t, r, outs=outs, inps=inps, root=root: fn(
                               t, outs[r], inps[r], root, segment_bytes=8),
                           lambda r, outs=outs, inps=inps, root=root, source=source, block=block:
                           mismatch(outs[r], source[r * block:(r + 1) * block])
                           or (mismatch(inps[r], source) if r == root else None))


def barrier_matrix(matrix, size):
    # Rank p-1 enters late; a barrier that let anyone leave before it entered would be seen.
    entered = [0] * size
    seen = [None] * size

    def call(fn, transport, rank):
        if rank == size - 1:
            time.sleep(0.05)
        entered[rank] = 1
        fn(transport, segment_bytes=8)
        seen[rank] = sum(entered)

    matrix.add("late last rank", call, lambda r: None if seen[r] == size else f"left after {seen[r]} of {size} entered")


MATRICES = {"broadcast": broadcast_matrix, "reduce": reduce_matrix, "allgather": allgather_matrix,
            "reduce_scatter": reduce_scatter_matrix, "alltoall": alltoall_matrix,
            "alltoallv": alltoallv_matrix, "gather": gather_matrix, "scatter": scatter_matrix,
            "barrier": barrier_matrix}
# The shared-memory ones need a transport with direct access to the peers' memory: on threads
# in test_shm_movers.py, under mpiexec in tests/mpi/shm_ranks.py and collectives_algorithms_ranks.py.
CASES = [(collective, name) for collective in MATRICES for name in algorithm_names(collective)
         if not getattr(get_algorithm(name, collective), "requires_shared_memory", False)]


@pytest.mark.parametrize("collective,name", CASES)
def test_every_algorithm_against_closed_form(collective, name):
    fn = get_algorithm(name, collective)
    for size in WORLD:
        matrix = Matrix(size)
        MATRICES[collective](matrix, size)
        matrix.run(fn, collective, name)


# -- the shape of each schedule ----------------------------------------------------------------
def record(collective, name, size, call):
    world = InProcessWorld(size, timeout=10, record=True)
    fn = get_algorithm(name, collective)
    world.run(lambda transport: call(fn, transport, transport.rank), collective=collective, algorithm=name)
    return world.records


def round_of(step):
    return step.rsplit(" segment", 1)[0]


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_binomial_broadcast_has_depth_log2_p_and_p_minus_1_messages(size):
    for root in roots_for(size):
        bufs = [np.zeros(6, np.int32) for _ in range(size)]
        records = record("broadcast", "binomial", size, lambda fn, t, r, bufs=bufs, root=root: fn(t, bufs[r], root))
        assert len(records) == size - 1
        assert sorted(r.dst for r in records) == sorted(set(range(size)) - {root})  # each receives once
        parent = {r.dst: r.src for r in records}
        served = defaultdict(list)  # each parent's children in the order it sends to them
        for r in records:
            served[r.src].append(r.dst)

        def rounds(rank, root=root, parent=parent, served=served):  # one send at a time: when ``rank`` has the data
            return 0 if rank == root else rounds(parent[rank]) + 1 + served[parent[rank]].index(rank)

        assert max(rounds(rank) for rank in range(size)) == math.ceil(math.log2(size))
        for rank in range(size):  # the tree is the binomial tree of relative ranks
            if rank != root:
                expected = (binomial_parent(relative_rank(rank, root, size), size) + root) % size
                assert parent[rank] == expected


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_chain_broadcast_forwards_each_segment_along_the_chain(size):
    root, count = 1 % size, 40
    bufs = [np.zeros(count, np.int64) for _ in range(size)]
    records = record("broadcast", "chain", size, lambda fn, t, r: fn(t, bufs[r], root, segment_bytes=64))
    assert all(r.dst == (r.src + 1) % size and r.dst != root for r in records)
    per_link = Counter((r.src, r.dst) for r in records)
    assert len(per_link) == size - 1 and set(per_link.values()) == {count * 8 // 64}


@pytest.mark.parametrize("size", [2, 3, 4, 6, 8])
def test_scatter_allgather_broadcast_delivers_each_byte_once(size):
    count = 12 * size
    for root in roots_for(size):
        bufs = [np.zeros(count, np.float32) for _ in range(size)]
        records = record("broadcast", "scatter_allgather", size,
                         lambda fn, t, r, bufs=bufs, root=root: fn(t, bufs[r], root))
        received = Counter()
        for r in records:
            received[r.dst] += r.nbytes
        assert received[root] == 0
        assert all(received[rank] == count * 4 for rank in range(size) if rank != root), received
        ring = [r for r in records if "ring" in r.step]
        assert all(relative_rank(r.dst, root, size) == relative_rank(r.src, root, size) + 1 for r in ring)
        assert len({r.step for r in ring}) <= size - 1


@pytest.mark.parametrize("size", [2, 3, 6, 8])
def test_binomial_reduce_sends_each_subtree_once_to_its_parent(size):
    root = size - 1
    bufs = [np.ones(5, np.int32) for _ in range(size)]
    records = record("reduce", "binomial", size, lambda fn, t, r: fn(t, bufs[r], root, ReduceOp.SUM))
    assert sorted(r.src for r in records) == sorted(set(range(size)) - {root})
    for r in records:
        assert r.dst == (binomial_parent(relative_rank(r.src, root, size), size) + root) % size


@pytest.mark.parametrize("size", [2, 4, 8])
def test_rabenseifner_reduce_halves_then_gathers_to_the_root(size):
    count, root = 16 * size, 0
    bufs = [np.ones(count, np.int64) for _ in range(size)]
    records = record("reduce", "rabenseifner", size, lambda fn, t, r: fn(t, bufs[r], root, ReduceOp.SUM))
    for rank in range(size):
        halving = [r.nbytes for r in records if r.src == rank and "halving" in r.step]
        assert halving == [count * 8 >> (i + 1) for i in range(int(math.log2(size)))]
    into_root = sum(r.nbytes for r in records if r.dst == root and "gather" in r.step)
    assert into_root == count * 8 * (size - 1) // size  # each block reaches the root once


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_ring_allgather_talks_to_neighbours_in_p_minus_1_steps(size):
    block = 3
    outs = [np.empty(block * size, np.int32) for _ in range(size)]
    inps = [np.full(block, rank, np.int32) for rank in range(size)]
    records = record("allgather", "ring", size, lambda fn, t, r: fn(t, outs[r], inps[r]))
    assert all(r.dst == (r.src + 1) % size for r in records)
    assert len({r.step for r in records}) == size - 1
    assert Counter(r.src for r in records) == dict.fromkeys(range(size), size - 1)
    assert {r.nbytes for r in records} == {block * 4}


@pytest.mark.parametrize("size", [2, 3, 4, 5, 7, 8])
def test_bruck_allgather_takes_ceil_log2_p_rounds(size):
    block = 2
    outs = [np.empty(block * size, np.int64) for _ in range(size)]
    inps = [np.full(block, rank, np.int64) for rank in range(size)]
    records = record("allgather", "bruck", size, lambda fn, t, r: fn(t, outs[r], inps[r]))
    rounds = sorted({r.step for r in records}, key=lambda step: int(step.split()[-1]))
    assert [int(step.split()[-1]) for step in rounds] == [1 << k for k in range(math.ceil(math.log2(size)))]
    for rank in range(size):  # every rank receives exactly the p - 1 blocks it lacks
        assert sum(r.nbytes for r in records if r.dst == rank) == (size - 1) * block * 8


@pytest.mark.parametrize("size", [2, 4, 8, 3, 6])
def test_recursive_doubling_allgather_rounds_double(size):
    block = 1
    outs = [np.empty(block * size, np.int64) for _ in range(size)]
    inps = [np.full(block, rank, np.int64) for rank in range(size)]
    records = record("allgather", "recursive_doubling", size, lambda fn, t, r: fn(t, outs[r], inps[r]))
    power = 1 << (size.bit_length() - 1)
    main = defaultdict(list)
    for r in records:
        if r.step.startswith("recursive doubling"):
            main[r.src].append(int(r.step.split()[-1]))
    assert all(distances == [1 << k for k in range(int(math.log2(power)))] for distances in main.values())
    assert len(main) == power


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_ring_reduce_scatter_talks_to_neighbours_in_p_minus_1_steps(size):
    block = 6
    inps = [np.ones(block * size, np.float64) for _ in range(size)]
    outs = [np.empty(block, np.float64) for _ in range(size)]
    records = record("reduce_scatter", "ring", size,
                     lambda fn, t, r: fn(t, outs[r], inps[r], ReduceOp.SUM, segment_bytes=16))
    assert all(r.dst == (r.src + 1) % size for r in records)
    assert len({round_of(r.step) for r in records}) == size - 1
    assert set(Counter(r.src for r in records).values()) == {(size - 1) * block * 8 // 16}


@pytest.mark.parametrize("size", [2, 4, 8])
def test_recursive_halving_reduce_scatter_message_sizes_halve(size):
    block = 4
    inps = [np.ones(block * size, np.int32) for _ in range(size)]
    outs = [np.empty(block, np.int32) for _ in range(size)]
    records = record("reduce_scatter", "recursive_halving", size,
                     lambda fn, t, r: fn(t, outs[r], inps[r], ReduceOp.SUM))
    for rank in range(size):
        assert [r.nbytes for r in records if r.src == rank] == [block * size * 4 >> (i + 1)
                                                                  for i in range(int(math.log2(size)))]


@pytest.mark.parametrize("collective,size", [(c, s) for c in ("reduce_scatter", "alltoall") for s in (2, 3, 4, 5, 8)])
def test_pairwise_has_p_minus_1_rounds_each_with_one_partner(collective, size):
    block = 2
    inps = [np.ones(block * size, np.int32) for _ in range(size)]
    outs = [np.empty(block * (size if collective == "alltoall" else 1), np.int32) for _ in range(size)]
    if collective == "alltoall":
        call = lambda fn, t, r: fn(t, outs[r], inps[r])  # noqa: E731
    else:
        call = lambda fn, t, r: fn(t, outs[r], inps[r], ReduceOp.SUM)  # noqa: E731
    records = record(collective, "pairwise", size, call)
    rounds = defaultdict(list)
    for r in records:
        rounds[round_of(r.step)].append(r)
    assert len(rounds) == size - 1
    for sends in rounds.values():
        assert sorted(r.src for r in sends) == list(range(size))  # everyone sends once
        assert sorted(r.dst for r in sends) == list(range(size))  # and hears from one rank
        if size & (size - 1) == 0:  # a power of two: the rounds pair ranks off
            pairs = {(r.src, r.dst) for r in sends}
            assert all((dst, src) in pairs for src, dst in pairs)


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_bruck_alltoall_takes_ceil_log2_p_rounds_of_half_the_blocks(size):
    block = 3
    inps = alltoall_blocks(size, block, np.int16)
    outs = [np.empty(block * size, np.int16) for _ in range(size)]
    records = record("alltoall", "bruck", size, lambda fn, t, r: fn(t, outs[r], inps[r]))
    by_round = defaultdict(list)
    for r in records:
        by_round[int(r.step.split()[-1])].append(r)
    assert sorted(by_round) == [1 << k for k in range(math.ceil(math.log2(size)))]
    for distance, sends in by_round.items():
        assert all(r.dst == (r.src + distance) % size for r in sends)
        moving = sum(1 for row in range(size) if row & distance)
        assert {r.nbytes for r in sends} == {moving * block * 2}


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_flat_broadcast_and_scattered_alltoall_take_one_step(size):
    root = size - 1
    bufs = [np.zeros(4, np.int32) for _ in range(size)]
    records = record("broadcast", "flat", size, lambda fn, t, r: fn(t, bufs[r], root))
    assert sorted((r.src, r.dst) for r in records) == [(root, peer) for peer in range(size) if peer != root]
    inps = alltoall_blocks(size, 2, np.int32)
    outs = [np.empty(2 * size, np.int32) for _ in range(size)]
    records = record("alltoall", "scattered", size, lambda fn, t, r: fn(t, outs[r], inps[r]))
    assert len({r.step for r in records}) == 1
    assert sorted((r.src, r.dst) for r in records) == [(a, b) for a in range(size) for b in range(size) if a != b]


@pytest.mark.parametrize("size", [2, 3, 4, 5, 7, 8])
def test_dissemination_barrier_takes_ceil_log2_p_rounds(size):
    records = record("barrier", "dissemination", size, lambda fn, t, r: fn(t))
    by_round = defaultdict(list)
    for r in records:
        by_round[int(r.step.split()[-1])].append(r)
    assert sorted(by_round) == [1 << k for k in range(math.ceil(math.log2(size)))]
    for distance, sends in by_round.items():
        assert sorted((r.src, r.dst) for r in sends) == [(rank, (rank + distance) % size) for rank in range(size)]


@pytest.mark.parametrize("collective", ["gather", "scatter"])
@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_binomial_gather_and_scatter_move_each_block_once_per_level(collective, size):
    block, root = 2, size // 2
    whole = np.arange(block * size, dtype=np.int32)
    if collective == "gather":
        outs = [np.empty(block * size, np.int32) if rank == root else None for rank in range(size)]
        inps = [np.full(block, rank, np.int32) for rank in range(size)]
    else:
        outs = [np.empty(block, np.int32) for _ in range(size)]
        inps = [whole.copy() if rank == root else None for rank in range(size)]
    records = record(collective, "binomial", size, lambda fn, t, r: fn(t, outs[r], inps[r], root))
    assert len(records) == size - 1
    at_root = [r for r in records if root in (r.src, r.dst)]
    assert len(at_root) == math.ceil(math.log2(size))
    assert sum(r.nbytes for r in at_root) == (size - 1) * block * 4


def test_pipelined_schedules_use_segments_of_scratch_not_a_buffer_copy():
    size, count, segment_bytes = 4, 1 << 14, 1024
    bufs = [np.ones(count, np.float32) for _ in range(size)]
    world = InProcessWorld(size)
    world.run(lambda t: get_algorithm("binomial", "reduce")(t, bufs[t.rank], 0, ReduceOp.SUM,
                                                            segment_bytes=segment_bytes))
    for transport in world.transports:
        scratch = transport.scratch_bytes()
        assert scratch < bufs[0].nbytes // 4, scratch
    assert np.all(bufs[0] == size)


def test_the_registry_lists_every_collectives_algorithms():
    import commlib

    assert commlib.algorithms("allgather") == ["bruck", "native", "recursive_doubling", "ring", "shm_direct"]
    assert commlib.algorithms() == commlib.algorithms("allreduce")
    assert "binomial" in commlib.algorithms("broadcast") and "dissemination" in commlib.algorithms("barrier")


def test_a_registered_algorithm_is_listed_and_callable_for_its_collective_only():
    import commlib
    from commlib import InvalidUsageError

    calls = []

    def mine(transport, out, inp, *, segment_bytes):
        calls.append(transport.rank)
        get_algorithm("ring", "allgather")(transport, out, inp, segment_bytes=segment_bytes)

    commlib.register_algorithm("test_mine", mine, collective="allgather")
    try:
        assert "test_mine" in commlib.algorithms("allgather")
        assert "test_mine" not in commlib.algorithms("allreduce")
        with pytest.raises(InvalidUsageError, match="unknown allreduce algorithm 'test_mine'"):
            get_algorithm("test_mine")
        outs = [np.empty(4, np.int8) for _ in range(2)]
        InProcessWorld(2).run(lambda t: get_algorithm("test_mine", "allgather")(
            t, outs[t.rank], np.full(2, t.rank, np.int8), segment_bytes=8))
        assert sorted(calls) == [0, 1] and outs[1].tolist() == [0, 0, 1, 1]
    finally:
        from commlib.algorithms import unregister_algorithm

        unregister_algorithm("test_mine", "allgather")
    with pytest.raises(InvalidUsageError, match="unknown collective 'allscatter'"):
        commlib.register_algorithm("x", mine, collective="allscatter")


def test_the_barrier_check_itself_catches_a_barrier_that_does_not_wait():
    """The barrier case above must be able to fail: a no-op 'barrier' fails it."""
    matrix = Matrix(4)
    barrier_matrix(matrix, 4)
    with pytest.raises(AssertionError, match="left after"):
        matrix.run(lambda transport, *, segment_bytes: None, "barrier", "no-op")
    assert threading.active_count() < 50
