"""The allreduce schedules on the in-process transport: results, shapes, and a seeded fuzz.

Every rank is a thread (commlib/transports/inprocess.py), so a whole world size x dtype x op x
size matrix runs in seconds. What counts is the same matrix under real mpiexec
(test_algorithms.py); these tests pin down the schedules' structure, which MPI cannot show.
"""

import math
from collections import Counter, defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from commlib import CommError, CommTimeoutError, ReduceOp
from commlib.algorithms.allreduce.tree import tree_links
from commlib.algorithms.common.pipeline import PIPELINE_WINDOW
from commlib.algorithms.registry import get_algorithm
from commlib.transports.inprocess import InProcessWorld
from tests.support.closed_form import DTYPE_NAMES, EXACT_OPS, closed_form, dtype_of, rank_values

ALGORITHMS = ["ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical"]
DTYPES = DTYPE_NAMES
OPS = EXACT_OPS  # AVG's one division: under mpiexec (tests/mpi/collectives_allreduce_ranks.py)
WORLD = range(1, 9)


def run_allreduce(name, inputs, op, segment_bytes, record=False):
    world = InProcessWorld(len(inputs), timeout=10, record=record)
    fn = get_algorithm(name)
    world.run(lambda transport: fn(transport, inputs[transport.rank], op, segment_bytes=segment_bytes),
              algorithm=name, nbytes=inputs[0].nbytes)
    return world


def sizes_for(size):
    return sorted({0, 1, max(size - 1, 1), size, 7 * size + 3})


@pytest.mark.parametrize("name", ALGORITHMS)
@pytest.mark.parametrize("size", WORLD)
def test_matrix_against_closed_form(name, size):
    cases = [(dtype_name, op, count, segment_bytes)
             for dtype_name in DTYPES for op in OPS for count in sizes_for(size)
             for segment_bytes in (8, 1 << 20)]  # many segments per chunk, and one
    inputs = {case: [rank_values(rank, case[2], case[1]).astype(dtype_of(case[0]))
                     for rank in range(size)] for case in cases}
    fn = get_algorithm(name)

    def every_case(transport):  # one thread per rank for the whole matrix: threads are slow to start
        for case in cases:
            fn(transport, inputs[case][transport.rank], case[1], segment_bytes=case[3])

    InProcessWorld(size, timeout=30).run(every_case, algorithm=name)
    for (dtype_name, op, count, segment_bytes), results in inputs.items():
        # int8/uint8 PROD wraps around the same way in the reference.
        expected = closed_form(size, count, op, dtype_of(dtype_name))
        for rank, result in enumerate(results):
            bad = np.flatnonzero(result != expected)
            assert bad.size == 0, (
                f"{name} p={size} {dtype_name} {op.name} n={count} seg={segment_bytes} "
                f"rank {rank} index {bad[0]}: got {result[bad[0]]!r}, expected {expected[bad[0]]!r}")


def bytes_sent_by_rank(records):
    total = Counter()
    for record in records:
        total[record.src] += record.nbytes
    return total


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_ring_talks_to_neighbours_in_2p_minus_2_equal_steps(size):
    count = 12 * size  # divisible by p: every chunk has the same size
    inputs = [np.full(count, rank + 1, np.float32) for rank in range(size)]
    world = run_allreduce("ring", inputs, ReduceOp.SUM, 1 << 20, record=True)
    assert all(record.dst == (record.src + 1) % size for record in world.records)
    steps = {record.step.rsplit(" segment", 1)[0] for record in world.records}
    assert len(steps) == 2 * (size - 1)
    per_rank = Counter(record.src for record in world.records)
    assert set(per_rank.values()) == {2 * (size - 1)}
    assert set(bytes_sent_by_rank(world.records).values()) == {2 * (size - 1) * count // size * 4}
    # Segmented: the same bytes; the reduce-scatter cut into 8-byte pieces, the allgather not.
    world = run_allreduce("ring", inputs, ReduceOp.SUM, 8, record=True)
    assert set(bytes_sent_by_rank(world.records).values()) == {2 * (size - 1) * count // size * 4}
    assert {r.nbytes for r in world.records if "reduce-scatter" in r.step} == {8}
    assert {r.nbytes for r in world.records if "allgather" in r.step} == {count // size * 4}


@pytest.mark.parametrize("size", [2, 3, 5, 7, 8])
def test_tree_sends_up_its_heap_then_down(size):
    inputs = [np.full(10, rank, np.int64) for rank in range(size)]
    world = run_allreduce("tree", inputs, ReduceOp.SUM, 1 << 20, record=True)
    up = [r for r in world.records if "reduce" in r.step]
    down = [r for r in world.records if "broadcast" in r.step]
    assert sorted((r.src, r.dst) for r in up) == sorted((child, tree_links(child, size)[0])
                                                        for child in range(1, size))
    assert sorted((r.dst, r.src) for r in down) == sorted((child, tree_links(child, size)[0])
                                                          for child in range(1, size))

    def depth(rank):
        return 0 if rank == 0 else 1 + depth(tree_links(rank, size)[0])

    assert max(depth(rank) for rank in range(size)) == int(math.log2(size))


@pytest.mark.parametrize("size", [2, 3, 4, 6, 8])
def test_recursive_doubling_rounds(size):
    count = 16
    inputs = [np.full(count, rank, np.int32) for rank in range(size)]
    world = run_allreduce("recursive_doubling", inputs, ReduceOp.SUM, 1 << 20, record=True)
    power = 1 << (size.bit_length() - 1)
    remainder = size - power
    rounds = defaultdict(list)
    for record in world.records:
        rounds[record.src].append(record)
    for rank in range(size):
        sent = rounds[rank]
        assert all(r.nbytes == count * 4 for r in sent)
        if rank < 2 * remainder and rank % 2 == 0:
            assert [r.step for r in sent] == ["fold-in segment 0"]
        else:
            main = [r for r in sent if r.step.startswith("recursive doubling")]
            assert len(main) == int(math.log2(power))
            distances = [int(r.step.split()[3]) for r in main]
            assert distances == [1 << i for i in range(len(main))]
            folded = rank < 2 * remainder
            assert len(sent) == len(main) + folded


@pytest.mark.parametrize("size", [2, 4, 8, 6])
def test_rabenseifner_message_sizes_halve_then_double(size):
    power = 1 << (size.bit_length() - 1)
    count = 64 * power
    inputs = [np.full(count, rank, np.int64) for rank in range(size)]
    world = run_allreduce("rabenseifner", inputs, ReduceOp.SUM, 1 << 30, record=True)
    full = count * 8
    for rank in range(2 * (size - power), size):  # the ranks that take part in every round
        sent = [r.nbytes for r in world.records if r.src == rank and "distance" in r.step]
        halving = [full >> (i + 1) for i in range(int(math.log2(power)))]
        assert sent == halving + halving[::-1], (rank, sent)


def test_scratch_is_segments_not_a_buffer_copy():
    size, count, segment_bytes = 4, 1 << 16, 1024
    for name in ("ring", "rabenseifner", "recursive_doubling", "tree"):
        inputs = [np.ones(count, np.float32) for _ in range(size)]
        world = run_allreduce(name, inputs, ReduceOp.SUM, segment_bytes)
        # window + 1 receive slots (tree: one per child), never a copy of the 256 KiB buffer
        slots = (PIPELINE_WINDOW + 1) * (2 if name == "tree" else 1)
        for transport in world.transports:
            scratch_bytes = transport.scratch_bytes()
            assert scratch_bytes <= slots * segment_bytes, (name, scratch_bytes)
            assert scratch_bytes < inputs[0].nbytes // 16, (name, scratch_bytes)


def test_inprocess_transport_errors_are_named():
    world = InProcessWorld(2, timeout=0.3)

    def lonely(transport):
        if transport.rank == 0:
            transport.step("step 7")
            transport.recv(np.empty(3, np.int32), 1)

    with pytest.raises(CommTimeoutError, match=r"rank 0: allreduce #1.*step 7.*from rank 1"):
        world.run(lonely)

    world = InProcessWorld(2, timeout=2)

    def mismatched(transport):
        if transport.rank == 0:
            transport.send(np.zeros(4, np.int32), 1)
        else:
            transport.recv(np.empty(3, np.int32), 0)

    with pytest.raises(CommError, match="receive of 12 B from rank 0 matched a send of 16 B"):
        world.run(mismatched)

    world = InProcessWorld(2, timeout=2)

    def scribbler(transport):
        buf = np.zeros(4, np.int32)
        peer = 1 - transport.rank
        pending = transport.post([(buf, peer)], [(np.empty(4, np.int32), peer)])
        if transport.rank == 0:
            buf += 1  # writing a buffer that is still being sent
        pending.wait()

    with pytest.raises(CommError, match="modified before the send completed"):
        world.run(scribbler)


def test_inprocess_native_collectives():
    size = 3
    world = InProcessWorld(size)

    def body(transport):
        rank = transport.rank
        total = np.array([rank + 1.0, 2.0])
        transport.native_allreduce(total, ReduceOp.PROD)
        gathered = np.empty(2 * size, np.int64)
        transport.native_allgather(gathered, np.array([rank, rank * 10]))
        scattered = np.empty(2, np.int64)
        transport.native_reduce_scatter(scattered, np.arange(2 * size), ReduceOp.SUM)
        root_value = np.array([rank])
        transport.native_broadcast(root_value, 2)
        transport.native_barrier()
        return total, gathered, scattered, root_value

    for rank, (total, gathered, scattered, root_value) in enumerate(world.run(body)):
        assert total.tolist() == [6.0, 8.0]
        assert gathered.tolist() == [0, 0, 1, 10, 2, 20]
        assert scattered.tolist() == [3 * 2 * rank, 3 * (2 * rank + 1)]
        assert root_value.tolist() == [2]


FUZZ_DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "int32", "int64", "uint8"]


@settings(max_examples=120, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(ALGORITHMS), size=st.integers(1, 8),
       dtype_name=st.sampled_from(FUZZ_DTYPES), op=st.sampled_from(OPS),
       count=st.integers(0, 300), segment_bytes=st.sampled_from([2, 8, 24, 100, 1 << 20]),
       seed=st.integers(0, 2**32 - 1))
def test_fuzz_against_float64_reference(name, size, dtype_name, op, count, segment_bytes, seed):
    dtype = dtype_of(dtype_name)
    rng = np.random.default_rng(seed)
    is_float = dtype.kind == "f" or dtype_name == "bfloat16"
    if is_float:
        low, high = (0.5, 1.5) if op is ReduceOp.PROD else (-4.0, 4.0)
        inputs = [rng.uniform(low, high, count).astype(dtype) for _ in range(size)]
    else:
        info = np.iinfo(dtype)
        inputs = [rng.integers(info.min, info.max, count, endpoint=True, dtype=dtype)
                  for _ in range(size)]
    wide = np.stack([x.astype(np.float64 if is_float else np.int64) for x in inputs])
    with np.errstate(over="ignore"):
        expected = {ReduceOp.SUM: wide.sum(0), ReduceOp.MIN: wide.min(0), ReduceOp.MAX: wide.max(0),
                    ReduceOp.PROD: wide.prod(0)}[op]
    run_allreduce(name, inputs, op, segment_bytes)
    for rank in range(1, size):  # bit-identical on every rank
        assert inputs[rank].tobytes() == inputs[0].tobytes(), f"rank {rank} differs from rank 0"
    if not is_float:  # integer arithmetic wraps the same way in the int64 reference
        np.testing.assert_array_equal(inputs[0], expected.astype(dtype))
        return
    eps = float(np.finfo(np.float32).eps if dtype_name == "bfloat16" else np.finfo(dtype).eps)
    if dtype_name == "bfloat16":
        eps = 2.0 ** -7
    scale = {ReduceOp.SUM: np.abs(wide).sum(0), ReduceOp.PROD: np.abs(expected)}.get(op, np.abs(expected))
    tolerance = 2 * size * eps * scale + 1e-300
    error = np.abs(inputs[0].astype(np.float64) - expected)
    worst = int(np.argmax(error - tolerance)) if count else 0
    assert np.all(error <= tolerance), (
        f"index {worst}: got {inputs[0][worst]!r}, expected {expected[worst]!r} (tol {tolerance[worst]:.3g})")
