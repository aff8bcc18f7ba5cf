"""``hierarchical`` allreduce and topologies on the in-process transport, at any host shape.

``InProcessWorld(p, hosts=...)`` emulates which ranks share a host, so the schedule's structure
is checked where MPI cannot show it: intra-host phases talk only within a host, the cross phase
only between hosts, every shard crosses once per direction per host; results match a closed
form at even, uneven and round-robin shapes, bit-identical on every rank.
"""

from collections import Counter

import numpy as np
import pytest

from commlib import ReduceOp
from commlib.algorithms.allreduce.hierarchical import MIN_PIECE_BYTES, PIECES, cross_algorithm, shard_plan
from commlib.algorithms.common.partition import segment_count, segment_elements, split_bounds
from commlib.algorithms.registry import get_algorithm
from commlib.topology import Topology
from commlib.transports.inprocess import InProcessWorld
from commlib.transports.view import RankView
from tests.support.closed_form import DTYPE_NAMES, EXACT_OPS, closed_form, dtype_of, rank_values

SHAPES = [[2, 2], [3, 2], [2, 3], [1, 1], [1, 3], [2, 1, 3], [3, 2, 1], [1, 1, 1, 1], [4],
          [[0, 2, 4], [1, 3, 5]], [[0, 3], [1, 4], [2, 5]]]


def world_size(shape):
    return sum(shape) if isinstance(shape[0], int) else sum(map(len, shape))


def shape_id(shape):
    return "+".join(str(h) if isinstance(h, int) else "/".join(map(str, h)) for h in shape)


# -- the topology ----------------------------------------------------------------------------
def test_topology_from_counts_and_from_rank_lists():
    topology = Topology.from_shape(4, [3, 2, 1])
    assert topology.host_ranks == ((0, 1, 2), (3, 4), (5,))
    assert (topology.host_index, topology.local_rank, topology.local_size) == (1, 1, 2)
    assert topology.ranks_per_host == (3, 2, 1) and topology.spans_hosts and not topology.uniform
    assert topology.host_name == "host1" and topology.host_name_of(5) == "host2"
    assert topology.describe() == "3 hosts: host0 [0,1,2], host1 [3,4], host2 [5]"
    round_robin = Topology.from_shape(3, [[1, 3, 5], [0, 2, 4]])
    assert round_robin.host_ranks == ((0, 2, 4), (1, 3, 5))  # ordered by first rank
    assert (round_robin.host_index, round_robin.local_rank) == (1, 1)
    single = Topology.single_host(2, 4)
    assert not single.spans_hosts and single.local_rank == 2 and single.uniform


def test_topology_subsets_keep_hosts_and_renumber_ranks():
    topology = Topology.from_shape(4, [[0, 2, 4], [1, 3, 5]], names=["a", "b"])
    sub = topology.subset([5, 4, 1])  # new ranks 0, 1, 2 are old ranks 5, 4, 1
    assert sub.rank == 1 and sub.host_ranks == ((0, 2), (1,)) and sub.host_names == ("b", "a")
    within = topology.subset([0, 2, 4])
    assert not within.spans_hosts and within.host_names == ("a",)


@pytest.mark.parametrize("bad", [((0, 1), (1, 2)), ((0, 2),), ((1, 0), (2,)), ((2,), (0, 1))])
def test_topology_rejects_what_is_not_a_partition_in_order(bad):
    with pytest.raises(ValueError, match="topology"):
        Topology(0, tuple(f"h{i}" for i in range(len(bad))), bad)


def test_inprocess_world_emulates_the_shape():
    world = InProcessWorld(6, hosts=[3, 2, 1])
    assert [t.topology.host_index for t in world.transports] == [0, 0, 0, 1, 1, 2]
    assert [t.topology.local_rank for t in world.transports] == [0, 1, 2, 0, 1, 0]
    with pytest.raises(ValueError, match="hold 5 ranks, not 6"):
        InProcessWorld(6, hosts=[3, 2])
    assert not InProcessWorld(3).transports[0].topology.spans_hosts


def test_a_rank_view_translates_ranks_and_names_the_real_peer():
    world = InProcessWorld(4, record=True, hosts=[2, 2], timeout=0.3)

    def odd_ranks_talk(transport):
        if transport.rank % 2:
            view = RankView(transport, [3, 1])
            assert view.size == 2 and view.rank == (0 if transport.rank == 3 else 1)
            assert view.topology.spans_hosts  # ranks 1 and 3 live on different hosts
            buf = np.full(3, transport.rank, np.int32)
            view.sendrecv(buf.copy(), 1 - view.rank, buf, 1 - view.rank)
            return buf.tolist()

    assert world.run(odd_ranks_talk)[1] == [3, 3, 3]
    assert sorted((r.src, r.dst) for r in world.records) == [(1, 3), (3, 1)]

    def lonely(transport):
        if transport.rank == 0:
            RankView(transport, [2, 0]).recv(np.empty(1, np.int8), 0)

    with pytest.raises(Exception, match="from rank 2"):  # the parent's rank, not the view's
        InProcessWorld(4, hosts=[2, 2], timeout=0.3).run(lonely)


# -- the plan --------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_every_shard_has_one_owner_per_host_and_chunks_tile_each_host(shape):
    topology = Topology.from_shape(0, shape)
    for count in (0, 1, 2, 5, 7, 100):
        plan = shard_plan(topology, 0, count)
        assert len(plan.shards) == max(topology.ranks_per_host)
        for host, ranks in enumerate(topology.host_ranks):
            chunks = plan.chunks(host)
            assert chunks[0][0] == 0 and chunks[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
            owned = [s for local in range(len(ranks)) for s in plan.owned_shards(host, local)]
            assert owned == list(range(len(plan.shards)))
            assert all(len(plan.owned_shards(host, local)) >= 1 for local in range(len(ranks)))
        for shard in range(len(plan.shards)):
            group = plan.cross_group(shard)
            assert [topology.host_of(r) for r in group] == list(range(topology.host_count))


# -- results ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_matrix_against_closed_form_at_every_shape(shape):
    size = world_size(shape)
    counts = sorted({0, 1, 2, size - 1 or 1, size, 7 * size + 3, 301})
    cases = [(dtype_name, op, count, segment_bytes)
             for dtype_name in DTYPE_NAMES for op in EXACT_OPS for count in counts for segment_bytes in (8, 1 << 20)]
    inputs = {case: [rank_values(rank, case[2], case[1]).astype(dtype_of(case[0])) for rank in range(size)]
              for case in cases}
    fn = get_algorithm("hierarchical")

    def every_case(transport):
        for case in cases:
            fn(transport, inputs[case][transport.rank], case[1], segment_bytes=case[3])

    InProcessWorld(size, timeout=60, hosts=shape).run(every_case, algorithm="hierarchical")
    for (dtype_name, op, count, segment_bytes), results in inputs.items():
        expected = closed_form(size, count, op, dtype_of(dtype_name))
        for rank, result in enumerate(results):
            bad = np.flatnonzero(result != expected)
            assert bad.size == 0, (
                f"shape {shape} {dtype_name} {op.name} n={count} seg={segment_bytes} rank {rank} "
                f"index {bad[0]}: got {result[bad[0]]!r}, expected {expected[bad[0]]!r}")


@pytest.mark.parametrize("shape", [[3, 2], [2, 2], [[0, 2, 4], [1, 3, 5]], [1, 2, 3]], ids=shape_id)
@pytest.mark.parametrize("pipelined", [False, True])
def test_random_floats_are_bit_identical_on_every_rank(shape, pipelined):
    size = world_size(shape)
    count = (PIECES * MIN_PIECE_BYTES) // 4 + 1001 if pipelined else 2001
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(size)]
    reference = np.sum(np.stack(inputs).astype(np.float64), axis=0)
    fn = get_algorithm("hierarchical")
    InProcessWorld(size, hosts=shape, timeout=60).run(
        lambda t: fn(t, inputs[t.rank], ReduceOp.SUM, segment_bytes=4096))
    for rank in range(1, size):
        assert inputs[rank].tobytes() == inputs[0].tobytes(), f"rank {rank} differs from rank 0"
    np.testing.assert_allclose(inputs[0], reference, rtol=1e-4, atol=1e-4)


# -- the schedule's shape --------------------------------------------------------------------
def record(shape, count, itemsize=8, segment_bytes=1 << 20):
    size = world_size(shape)
    inputs = [np.full(count, rank + 1, np.dtype(f"i{itemsize}")) for rank in range(size)]
    world = InProcessWorld(size, record=True, hosts=shape, timeout=60)
    fn = get_algorithm("hierarchical")
    world.run(lambda t: fn(t, inputs[t.rank], ReduceOp.SUM, segment_bytes=segment_bytes))
    assert all((x == size * (size + 1) // 2).all() for x in inputs)
    return world


@pytest.mark.parametrize("shape", [[2, 2], [3, 2], [1, 3], [2, 1, 3], [3, 3, 3], [[0, 2, 4], [1, 3, 5]]],
                         ids=shape_id)
def test_intra_phases_stay_in_a_host_and_the_cross_phase_only_crosses(shape):
    count = 2 * 3 * 5 * 7 * 4  # divisible by every shard count here
    world = record(shape, count)
    topology = world.topology
    phases = Counter()
    for r in world.records:
        same = topology.same_host(r.src, r.dst)
        if "intra-host" in r.step:
            assert same, r
            phases["intra"] += r.nbytes
        else:
            assert "cross-host" in r.step and not same, r
            phases["cross"] += r.nbytes
    hosts = topology.host_count
    # Every shard crosses once per direction per host (two hosts: one whole-shard exchange; more:
    # 2(H-1)/H of it with a ring, log2(H) with recursive doubling on small shards).
    if hosts == 2:
        for host in range(hosts):
            leaving = sum(r.nbytes for r in world.records if "cross" in r.step and topology.host_of(r.src) == host)
            arriving = sum(r.nbytes for r in world.records if "cross" in r.step and topology.host_of(r.dst) == host)
            assert leaving == arriving == count * 8, (host, leaving, arriving)
    # Inside a host of L ranks, each rank sends (L-1) chunks in each intra phase (equal chunks).
    for host, ranks in enumerate(topology.host_ranks):
        if len(ranks) == max(topology.ranks_per_host):
            sent = Counter()
            for r in world.records:
                if "intra" in r.step and r.src in ranks:
                    sent[r.src] += r.nbytes
            chunk = count * 8 // len(ranks)
            assert set(sent.values()) == ({2 * (len(ranks) - 1) * chunk} if len(ranks) > 1 else set()), (host, sent)


def test_degenerate_shapes_have_only_one_kind_of_phase():
    single_host = record([4], 40)
    assert single_host.records and all("intra-host" in r.step for r in single_host.records)
    one_rank_per_host = record([1, 1, 1], 40)
    assert one_rank_per_host.records and all("cross-host" in r.step for r in one_rank_per_host.records)


def test_smaller_hosts_give_some_ranks_several_shards():
    world = record([3, 2], 30)  # three shards of 10: host 1's local rank 1 owns two of them
    cross = [r for r in world.records if "cross" in r.step]
    assert Counter(r.src for r in cross) == Counter({0: 1, 1: 1, 2: 1, 3: 1, 4: 2})
    assert {(r.src, r.dst) for r in cross} == {(0, 3), (3, 0), (1, 4), (4, 1), (2, 4), (4, 2)}


def test_buffers_smaller_than_the_shard_count_skip_empty_shards():
    world = record([3, 3], 2)  # shards of 1, 1 and 0 elements: the empty one sends nothing
    cross = [r for r in world.records if "cross" in r.step]
    assert sorted(r.src for r in cross) == [0, 1, 3, 4]


def test_pipelined_pieces_cross_separately_and_move_the_same_bytes():
    count = PIECES * MIN_PIECE_BYTES // 8 + 5  # int64: PIECES pieces of just over a MiB
    segment_bytes = 1 << 18
    pipelined = record([2, 2], count, segment_bytes=segment_bytes)
    topology = pipelined.topology
    cross = [r for r in pipelined.records if not topology.same_host(r.src, r.dst)]
    assert sum(r.nbytes for r in cross) == 2 * count * 8  # n leaves each of the 2 hosts
    # Each piece's shards cross on their own: one segmented exchange per piece and rank.
    def exchanges(local, pieces):  # segments of this local rank's shard, summed over pieces
        return sum(segment_count(hi - lo, segment_elements(segment_bytes, 8))
                   for start, stop in split_bounds(0, count, pieces)
                   for lo, hi in [split_bounds(start, stop, 2)[local]])

    assert exchanges(0, PIECES) != exchanges(0, 1)
    assert Counter(r.src for r in cross) == Counter({rank: exchanges(rank % 2, PIECES) for rank in range(4)})


def test_cross_phase_schedule_choice():
    assert cross_algorithm(2, 1 << 30) == "recursive_doubling"
    assert cross_algorithm(4, 1 << 10) == "recursive_doubling"
    assert cross_algorithm(4, 1 << 20) == "rabenseifner"
    assert cross_algorithm(3, 1 << 20) == "ring"
