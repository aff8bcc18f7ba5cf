"""The shared-memory algorithms on P threads of one process, and the pieces under them.

Each thread-rank gets a :class:`SharedMemoryTransport` over the same anonymous mappings (the
segments), with tiny slots and staging halves so short inputs take many rounds and chunks. What
counts is the same matrix under real mpiexec (``test_shm.py``); here the whole world-size x dtype
x op x size matrix runs in seconds, and the parts MPI cannot show are pinned down: the schedule's
order, mixed symmetric/plain buffers, mismatch and timeout messages, the heap's bookkeeping.
"""

import hashlib
import mmap

import numpy as np
import pytest

from commlib import CollectiveMismatchError, CommTimeoutError, ReduceOp
from commlib.algorithms.common.partition import rounds_last_first
from commlib.algorithms.registry import get_algorithm
from commlib.algorithms.shm.twoshot import chunk_spans, gather_order, interleaved_chunks, reduce_order, round_slices
from commlib.shm.symmetric_heap import SymmetricHeap
from commlib.transports.inprocess import InProcessWorld
from commlib.transports.shm.transport import SegmentLayout, SharedMemoryTransport
from tests.support.closed_form import DTYPE_NAMES, OPS, closed_form, dtype_of, rank_values

ALGORITHMS = ["shm_oneshot", "shm_twoshot"]


class SharedWorld:
    """``size`` thread-ranks, each with a shared-memory transport over the same segments."""

    def __init__(self, size, *, slot_bytes=64, staging_bytes=256, heap_bytes=16 << 20, timeout=20.0):
        self.layout = SegmentLayout.create(slot_bytes, staging_bytes, heap_bytes)
        self.segments = [mmap.mmap(-1, self.layout.total_bytes) for _ in range(size)]
        self.world = InProcessWorld(size, timeout=timeout)
        self.transports = [SharedMemoryTransport(self.segments, rank, self.layout, p2p=self.world.transports[rank])
                           for rank in range(size)]
        self.heap = SymmetricHeap(self.layout.heap_start, self.layout.total_bytes)

    def symmetric(self, count, dtype):
        """The same heap place in every rank's segment, as arrays (what ProcessGroup.alloc does)."""
        region = self.heap.place(count * dtype.itemsize)
        return [np.frombuffer(segment, dtype, count, region.offset) for segment in self.segments]

    def run(self, fn):
        return self.world.run(lambda p2p: fn(self.transports[p2p.rank]))


@pytest.mark.parametrize("size", range(1, 9))
def test_matrix_on_symmetric_plain_and_mixed_buffers(size):
    """dtype x op x odd sizes x both algorithms x (symmetric, plain, symmetric on even ranks only),
    with 8-byte chunks and 64/256-byte slots/staging so every size takes several rounds."""
    world = SharedWorld(size)
    counts = sorted({0, 1, max(size - 1, 1), size, 7 * size + 3, 101})
    cases, buffers = [], {}
    for name in ALGORITHMS:
        for dtype_name in DTYPE_NAMES:
            dtype = dtype_of(dtype_name)
            for op in OPS:
                if op is ReduceOp.AVG and dtype.kind in "iu":
                    continue
                if op is ReduceOp.PROD and dtype.itemsize == 1 and size > 4:
                    continue  # 2**8 overflows 8 bits; the overflow itself is not under test
                for count in counts:
                    for kind in ("symmetric", "plain", "mixed"):
                        case = (name, dtype_name, op, count, kind)
                        symmetric = world.symmetric(count, dtype)
                        per_rank = []
                        for rank in range(size):
                            use_symmetric = kind == "symmetric" or (kind == "mixed" and rank % 2 == 0)
                            buf = symmetric[rank] if use_symmetric else np.empty(count, dtype)
                            buf[...] = rank_values(rank, count, op).astype(dtype)
                            per_rank.append(buf)
                        cases.append(case)
                        buffers[case] = per_rank

    def every_case(transport):
        for case in cases:
            fn = get_algorithm(case[0])
            fn(transport, buffers[case][transport.rank], case[2], segment_bytes=8)

    world.run(every_case)
    for case in cases:
        name, dtype_name, op, count, kind = case
        dtype = dtype_of(dtype_name)
        expected = closed_form(size, count, op, None if op is ReduceOp.AVG else dtype)
        for rank, result in enumerate(buffers[case]):
            if op is ReduceOp.AVG or (size == 1 and op is ReduceOp.AVG):
                ok = np.allclose(result.astype(np.float64), expected, rtol=1e-2 if dtype.itemsize == 2 else 1e-6)
            else:
                ok = np.array_equal(result.astype(np.float64), expected.astype(np.float64))
            assert ok, (f"{name} p={size} {dtype_name} {op.name} n={count} {kind} rank {rank}: "
                        f"got {result[:8]!r}, expected {expected[:8]!r}")


@pytest.mark.parametrize("size", [2, 3, 5, 8])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_random_floats_end_with_the_same_bytes_on_every_rank(name, size):
    world = SharedWorld(size, slot_bytes=256, staging_bytes=1024)
    rng = np.random.default_rng(7)
    cases = [(dtype, op, count) for dtype in ("float16", "float32", "float64")
             for op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG) for count in (size + 1, 1001)]
    inputs = {case: [rng.uniform(0.5, 1.5, case[2]).astype(case[0]) for _ in range(size)] for case in cases}
    fn = get_algorithm(name)
    world.run(lambda transport: [fn(transport, inputs[case][transport.rank], case[1], segment_bytes=64)
                                 for case in cases])
    for case, results in inputs.items():
        digests = {hashlib.sha1(result.tobytes()).hexdigest() for result in results}
        assert len(digests) == 1, f"{name} p={size} {case}: ranks hold different bytes"


def test_twoshot_schedule_rotates_and_covers_every_element_once():
    for size in range(1, 9):
        for count in (0, 1, size - 1, size, 7 * size + 3, 1000):
            slices = round_slices(count, size)
            assert slices[0][0] == 0 and slices[-1][1] == count
            assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
            assert max(hi - lo for lo, hi in slices) - min(hi - lo for lo, hi in slices) <= 1
            for lo, hi in slices:
                spans = chunk_spans((lo, hi), 3)
                assert sum(b - a for a, b in spans) == hi - lo and all(b - a <= 3 for a, b in spans)
        for rank in range(size):
            # Own contribution first, then the peers in rotated order: at any step the P ranks
            # read P different ranks' memory.
            assert reduce_order(rank, size) == [(rank + step) % size for step in range(size)]
            assert sorted(gather_order(rank, size)) == sorted(set(range(size)) - {rank})
        for step in range(size):
            assert sorted(reduce_order(rank, size)[step] for rank in range(size)) == list(range(size))
        # The push's chunks: every element on exactly one rank, every rank some (from P elements).
        for count in (0, 1, size, 7 * size + 3, 1000):
            owned = [interleaved_chunks(count, rank, size, 64) for rank in range(size)]
            covered = sorted(span for chunks in owned for span in chunks)
            ends = [hi for _, hi in covered]
            assert [lo for lo, _ in covered] == ([0] + ends[:-1] if covered else [])  # back to back from 0
            assert sum(hi - lo for lo, hi in covered) == count
            assert count < size or all(owned), (count, owned)
            # Last first: a buffer written front to back just before has its end in cache.
            assert all(chunks == sorted(chunks, reverse=True) for chunks in owned), owned
    # The rounds: back to back over the buffer, none longer than asked, last first.
    for count, round_elems in ((0, 4), (1, 4), (8, 4), (9, 4), (1000, 64)):
        rounds = rounds_last_first(count, round_elems)
        assert rounds == sorted(rounds, reverse=True)
        forward = rounds[::-1]
        assert [lo for lo, _ in forward] == ([0] + [hi for _, hi in forward[:-1]] if count else [])
        assert sum(hi - lo for lo, hi in rounds) == count and all(hi - lo <= round_elems for lo, hi in rounds)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("writable_heaps", [False, True])
def test_twoshot_pushes_where_peers_heaps_are_writable_and_pulls_where_not(tmp_path, size, writable_heaps):
    """As under mpiexec: segments in files, peers' mapped read-only. With a writable mapping of
    each peer's heap (what open_host_memory makes) symmetric buffers take the push, which
    publishes no chunk progress; without one the pull. Both end with the reduction everywhere."""
    layout = SegmentLayout.create(64, 512, 1 << 16)
    paths = []
    for rank in range(size):
        paths.append(tmp_path / f"segment{rank}")
        paths[-1].write_bytes(bytes(layout.total_bytes))
    files = [open(path, "r+b") for path in paths]
    world = InProcessWorld(size, timeout=20.0)
    transports = []
    for rank in range(size):
        segments = [mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_WRITE if peer == rank else mmap.ACCESS_READ)
                    for peer, f in enumerate(files)]
        heaps = [None if peer == rank else mmap.mmap(f.fileno(), layout.total_bytes - layout.heap_start,
                                                     access=mmap.ACCESS_WRITE, offset=layout.heap_start)
                 for peer, f in enumerate(files)] if writable_heaps else None
        transports.append(SharedMemoryTransport(segments, rank, layout, p2p=world.transports[rank], heaps=heaps))
    count = 1000  # 8000 bytes: 16 rounds of 512
    region = SymmetricHeap(layout.heap_start, layout.total_bytes).place(count * 8)
    buffers = [np.frombuffer(transport.own_segment, np.float64, count, region.offset) for transport in transports]
    for rank, buf in enumerate(buffers):
        buf[...] = np.arange(count) + rank
    world.run(lambda p2p: get_algorithm("shm_twoshot")(transports[p2p.rank], buffers[p2p.rank], ReduceOp.SUM,
                                                        segment_bytes=64))
    for buf in buffers:
        assert np.array_equal(buf, np.arange(count) * size + sum(range(size)))
    for transport in transports:
        assert transport.peers_writable == writable_heaps
        published = [transport.progress_of(peer, transport.epoch) for peer in range(size)]
        assert (max(published) == 0) == writable_heaps, published
    with pytest.raises(ValueError, match="read-only"):
        transports[0].peer_bytes(1, 0, 8).fill(1)  # a peer's control page stays read-only either way
    buffers.clear()  # the mappings close only without arrays over them
    for transport in transports:
        transport.close()
    for f in files:
        f.close()


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_rank_passing_another_size_gets_a_mismatch_error_on_every_rank(name):
    world = SharedWorld(3, slot_bytes=4096, staging_bytes=4096, timeout=5.0)
    errors = []

    def body(transport):
        count = 12 if transport.rank == 1 else 10
        try:
            get_algorithm(name)(transport, np.ones(count, np.float32), ReduceOp.SUM)
        except CollectiveMismatchError as exc:
            errors.append(str(exc))

    world.run(body)
    assert len(errors) == 3, errors
    assert all("rank 1 contributes 48 B of float32 SUM" in e or "this rank 48 B" in e for e in errors), errors


# Each shared-memory algorithm's first wait (the data movers' shm_direct: see test_shm_movers.py).
FIRST_WAITS = {name: (lambda transport, name=name: get_algorithm(name)(transport, np.ones(4, np.float32), ReduceOp.SUM))
               for name in ALGORITHMS}
FIRST_WAITS["shm_direct broadcast"] = lambda transport: get_algorithm("shm_direct", "broadcast")(
    transport, np.ones(4, np.float32), 0, segment_bytes=64)


@pytest.mark.parametrize("name", list(FIRST_WAITS))
def test_a_missing_rank_is_a_timeout_naming_it(name):
    world = SharedWorld(3, timeout=1.0)
    seen = []

    def body(transport):
        if transport.rank == 2:
            return  # never arrives
        try:
            FIRST_WAITS[name](transport)
        except CommTimeoutError as exc:
            seen.append(str(exc))

    world.run(body)
    assert len(seen) == 2, seen
    assert all("rank 2 (pid" in message and "to arrive" in message and "timed out after 1 s" in message
               for message in seen), seen


def test_heap_places_identically_and_reclaims_only_what_every_rank_released():
    heaps = [SymmetricHeap(4096, 4096 + 64 * 4096) for _ in range(2)]
    regions = [[heap.place(nbytes) for nbytes in (1, 4096, 5000, 100)] for heap in heaps]
    assert regions[0] == regions[1]
    assert [r.nbytes for r in regions[0]] == [4096, 4096, 8192, 4096]
    assert [r.offset for r in regions[0]] == [4096, 8192, 12288, 20480]
    heaps[0].release(regions[0][1].serial)
    heaps[0].release(regions[0][2].serial)
    heaps[1].release(regions[1][2].serial)  # rank 1 still holds region 1
    serials = heaps[0].live_serials()
    assert serials == heaps[1].live_serials()
    combined = np.minimum(heaps[0].released_flags(serials), heaps[1].released_flags(serials))
    for heap in heaps:
        assert heap.reclaim(serials, combined.tolist()) == 8192  # only region 2
    again = [heap.place(8192) for heap in heaps]
    assert again[0] == again[1] and again[0].offset == 12288  # first fit reuses the hole
    assert heaps[0].place(64 * 4096) is None  # more than is free: nothing placed
    heaps[0].undo(again[0])
    assert heaps[0].largest_free() >= 8192


def test_a_free_range_merges_with_both_neighbours():
    heap = SymmetricHeap(0, 10 * 4096)
    a, b, c = (heap.place(4096) for _ in range(3))
    for region in (a, c, b):
        heap.release(region.serial)
        heap.reclaim([region.serial], [1])
    assert heap.largest_free() == 10 * 4096 and heap.free_bytes() == 10 * 4096


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_symmetric_buffer_rewritten_right_after_each_call_never_leaks_into_a_peer(size):
    """The caller may write its symmetric buffer as soon as the allreduce returns: the peers must
    have finished reading it by then (each call's result is checked before the next input)."""
    world = SharedWorld(size, staging_bytes=1 << 16)
    count = 4001
    buffers = world.symmetric(count, np.dtype(np.int64))
    bad = []

    def body(transport):
        buf = buffers[transport.rank]
        fn = get_algorithm("shm_twoshot")
        for step in range(60):
            buf[...] = np.arange(count) * (step + 1) + transport.rank
            fn(transport, buf, ReduceOp.SUM, segment_bytes=512)
            expected = np.arange(count) * (step + 1) * size + sum(range(size))
            if not np.array_equal(buf, expected):
                bad.append((transport.rank, step, int(np.flatnonzero(buf != expected)[0])))
                return

    world.run(body)
    assert not bad, bad


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("symmetric", [False, True])
def test_twoshot_slice_hook_sees_each_reduced_slice_once_and_spreads_its_result(size, symmetric):
    """The hierarchical entry point: the hook gets this rank's reduced slice of every round (here
    it stands for the other hosts by doubling it); every rank ends with the hook's result."""
    world = SharedWorld(size, staging_bytes=512)
    count = 1000
    buffers = world.symmetric(count, np.dtype(np.float64)) if symmetric else [np.empty(count) for _ in range(size)]
    for rank, buf in enumerate(buffers):
        buf[...] = np.arange(count) + rank
    seen = [[] for _ in range(size)]

    def hook_for(rank):
        def across_hosts(slice_):
            seen[rank].append(slice_.size)
            slice_ *= 2
        return across_hosts

    world.run(lambda transport: get_algorithm("shm_twoshot")(
        transport, buffers[transport.rank], ReduceOp.SUM, segment_bytes=64, slice_hook=hook_for(transport.rank)))
    expected = 2.0 * (np.arange(count) * size + sum(range(size)))
    for rank, buf in enumerate(buffers):
        assert np.array_equal(buf, expected), rank
    assert sum(sum(sizes) for sizes in seen) == count  # every element went through exactly one hook
