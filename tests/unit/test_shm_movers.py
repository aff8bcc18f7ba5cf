"""The data movers' ``shm_direct`` (broadcast, allgather, gather, scatter, alltoall) on P threads
of one process, each with a shared-memory transport over the same segments (see
test_shm_schedules.py's SharedWorld): tiny staging halves so every size takes many rounds and
chunks; plain, symmetric and mixed sources; size mismatches end in named errors (a missing rank:
test_shm_schedules.py). Under real mpiexec: tests/mpi/shm_ranks.py and collectives_algorithms_ranks.py."""

import os
import time

import numpy as np
import pytest

from commlib import CollectiveMismatchError, ReduceOp
from commlib.algorithms.registry import get_algorithm
from tests.support.closed_form import random_bytes
from tests.unit.test_shm_schedules import SharedWorld

DTYPES = [np.dtype(np.uint8), np.dtype(np.float32), np.dtype(np.int64)]  # movers copy bytes: three item sizes


class Sources:
    """Per-rank source arrays: in the symmetric heap (every rank, or even ranks for "mixed") or plain."""

    def __init__(self, world, size, kind):
        self.world, self.size, self.kind = world, size, kind

    def make(self, count, dtype, seeds):
        shared = self.world.symmetric(count, dtype)
        arrays = []
        for rank in range(self.size):
            symmetric = self.kind == "symmetric" or (self.kind == "mixed" and rank % 2 == 0)
            array = shared[rank] if symmetric else np.empty(count, dtype)
            array[...] = random_bytes(seeds[rank], count, dtype)
            arrays.append(array)
        return arrays


@pytest.mark.parametrize("size", range(1, 7))
def test_every_mover_delivers_bit_for_bit_from_plain_symmetric_and_mixed_sources(size):
    world = SharedWorld(size, staging_bytes=256)  # a page: rounds of 4 KiB over all blocks
    calls, checks = [], []
    for dtype in DTYPES:
        for count in sorted({0, 1, max(size - 1, 1), size, 7 * size + 3, 1500}):
            for kind in ("plain", "symmetric", "mixed"):
                sources = Sources(world, size, kind)
                label = f"p={size} {dtype} n={count} {kind}"
                blocks = [random_bytes(100 * r + count, count, dtype) for r in range(size)]
                matrices = [random_bytes(9000 + r, count * size, dtype) for r in range(size)]

                inp = sources.make(count, dtype, [100 * r + count for r in range(size)])
                outs = [np.zeros(count * size, dtype) for _ in range(size)]
                calls.append(lambda t, inp=inp, outs=outs: get_algorithm("shm_direct", "allgather")(
                    t, outs[t.rank], inp[t.rank], segment_bytes=8))
                checks += [(f"allgather {label} rank {r}", outs[r], np.concatenate(blocks)) for r in range(size)]

                inp = sources.make(count * size, dtype, [9000 + r for r in range(size)])
                outs = [np.zeros(count * size, dtype) for _ in range(size)]
                calls.append(lambda t, inp=inp, outs=outs: get_algorithm("shm_direct", "alltoall")(
                    t, outs[t.rank], inp[t.rank], segment_bytes=8))
                checks += [(f"alltoall {label} rank {r}", outs[r],
                            np.concatenate([m[r * count:(r + 1) * count] for m in matrices])) for r in range(size)]

                for root in sorted({0, size - 1}):
                    bufs = sources.make(count, dtype, [100 * r + count for r in range(size)])
                    calls.append(lambda t, bufs=bufs, root=root: get_algorithm("shm_direct", "broadcast")(
                        t, bufs[t.rank], root, segment_bytes=8))
                    checks += [(f"broadcast {label} root {root} rank {r}", bufs[r], blocks[root]) for r in range(size)]

                    inp = sources.make(count, dtype, [100 * r + count for r in range(size)])
                    gathered = np.zeros(count * size, dtype)
                    calls.append(lambda t, inp=inp, root=root, gathered=gathered: get_algorithm("shm_direct", "gather")(
                        t, gathered if t.rank == root else None, inp[t.rank], root, segment_bytes=8))
                    checks.append((f"gather {label} root {root}", gathered, np.concatenate(blocks)))

                    whole = sources.make(count * size, dtype, [9000 + r for r in range(size)])
                    parts = [np.zeros(count, dtype) for _ in range(size)]
                    calls.append(lambda t, whole=whole, root=root, parts=parts: get_algorithm("shm_direct", "scatter")(
                        t, parts[t.rank], whole[root] if t.rank == root else None, root, segment_bytes=8))
                    checks += [(f"scatter {label} root {root} rank {r}", parts[r],
                                matrices[root][r * count:(r + 1) * count]) for r in range(size)]

    world.run(lambda transport: [call(transport) for call in calls])
    for what, actual, expected in checks:
        assert actual.tobytes() == expected.tobytes(), what


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_allgather_pushes_when_every_buffer_is_symmetric_and_reads_otherwise(size):
    """Sources x outputs, each plain, symmetric or mixed (symmetric on even ranks): bit for bit
    everywhere; only where every source and every output is symmetric do the ranks push, the
    whole allgather in one epoch (the reads take one per round: 3 of 4 KiB for 12 KiB here)."""
    world = SharedWorld(size, staging_bytes=256)  # a page
    dtype, count = np.dtype(np.float32), 3001
    blocks = [random_bytes(7 * r + 1, count, dtype) for r in range(size)]
    for source_kind in ("plain", "symmetric", "mixed"):
        for output_kind in ("plain", "symmetric", "mixed"):
            inp = Sources(world, size, source_kind).make(count, dtype, [7 * r + 1 for r in range(size)])
            outs = Sources(world, size, output_kind).make(count * size, dtype, [0] * size)
            epochs = [0] * size

            def body(transport, inp=inp, outs=outs, epochs=epochs):
                before = transport.epoch
                get_algorithm("shm_direct", "allgather")(transport, outs[transport.rank], inp[transport.rank],
                                                        segment_bytes=512)
                epochs[transport.rank] = transport.epoch - before

            world.run(body)
            label = f"p={size} sources {source_kind} outputs {output_kind}"
            for rank in range(size):
                assert outs[rank].tobytes() == np.concatenate(blocks).tobytes(), (label, rank)
            pushed = source_kind == output_kind == "symmetric"
            expected = 0 if size == 1 else 1 if pushed else 3
            assert epochs == [expected] * size, (label, epochs)


def test_every_rank_has_its_share_in_every_round_of_an_alltoall():
    """Rounds cover the same part of every block: with rounds over the source's first bytes, the
    ranks that read the later blocks would wait through the early rounds (measured: a 64 MiB
    alltoall on symmetric buffers took 9.2 ms against MPI's 3.9 before, 6.3 against 6.4 after)."""
    size, count = 4, 3000
    world = SharedWorld(size, staging_bytes=4096)
    copies = {rank: [] for rank in range(size)}
    inp = [np.full(count * size, rank, np.uint8) for rank in range(size)]
    outs = [np.zeros(count * size, np.uint8) for _ in range(size)]

    def body(transport):
        real_depart = transport.depart

        def depart():  # count the bytes of out this rank has filled by the end of each round
            copies[transport.rank].append(int(np.count_nonzero(outs[transport.rank] != 0)))
            real_depart()

        transport.depart = depart
        get_algorithm("shm_direct", "alltoall")(transport, outs[transport.rank], inp[transport.rank],
                                                segment_bytes=1 << 20)

    world.run(body)
    for rank in range(size):
        assert outs[rank].tolist() == np.repeat(np.arange(size), count).tolist()
        filled = copies[rank]
        assert len(filled) == 3  # 3000 bytes per block, 1 KiB of each block per 4 KiB round
        # Rank 0's own block is zeros; the others' fill in every round.
        assert all(later > earlier for earlier, later in zip([0] + filled, filled)), (rank, filled)


@pytest.mark.parametrize("collective", ["broadcast", "allgather", "alltoall"])
def test_a_rank_passing_another_size_gets_a_mismatch_error_on_every_rank(collective):
    world = SharedWorld(3, staging_bytes=4096, timeout=5.0)
    errors = []

    def body(transport):
        count = 12 if transport.rank == 1 else 9
        fn = get_algorithm("shm_direct", collective)
        try:
            if collective == "broadcast":
                fn(transport, np.ones(count, np.float32), 0, segment_bytes=64)
            else:
                fn(transport, np.ones(count * 3, np.float32), np.ones(count * (3 if collective == "alltoall" else 1),
                                                                         np.float32), segment_bytes=64)
        except CollectiveMismatchError as exc:
            errors.append(str(exc))

    world.run(body)
    assert len(errors) == 3, errors
    scale = 3 if collective == "alltoall" else 1  # its source is the whole inp
    sizes = (f"{48 * scale} B", f"{36 * scale} B")
    assert all(f"{collective} bytes" in e and all(size in e for size in sizes) for e in errors), errors


def test_ranks_in_different_kinds_of_round_get_a_mismatch_error_long_before_the_timeout():
    """One rank in a slot round (shm_oneshot), the other in an arrival round (shm_twoshot) of the
    same epoch, as ``auto`` does when only one rank's buffer is symmetric: each sees the other's
    counter for the epoch and names the divergence, instead of waiting for the 30 s deadline."""
    world = SharedWorld(2, slot_bytes=4096, staging_bytes=4096, timeout=30.0)
    errors, elapsed = [], []

    def body(transport):
        name = "shm_twoshot" if transport.rank == 0 else "shm_oneshot"
        start = time.monotonic()
        try:
            get_algorithm(name)(transport, np.ones(64, np.float32), ReduceOp.SUM, segment_bytes=64)
        except CollectiveMismatchError as exc:
            errors.append(str(exc))
        elapsed.append(time.monotonic() - start)

    world.run(body)
    assert len(errors) == 2, errors
    assert max(elapsed) < 15, elapsed  # detected at the first liveness check (0.1 s), far below 30 s
    assert all("the ranks chose different algorithms" in e and "pg.alloc" in e for e in errors), errors
    assert any("this rank as a slot round (shm_oneshot)" in e for e in errors), errors
    assert any("this rank as an arrival round" in e for e in errors), errors


@pytest.mark.parametrize("kind", ["plain", "symmetric", "mixed"])
def test_two_rank_rooted_movers_split_by_cross_memory_attach_deliver_every_byte(kind):
    """Threads of one process may copy from their own pid's memory, so the split path (the rank
    holding the bytes writes part of the other's buffer, the other reads the rest) runs here for
    broadcast, scatter and gather; under mpiexec it runs wherever the group's probe found
    cross-memory attach working."""
    from commlib.algorithms.shm.direct import COOPERATIVE_BYTES
    from commlib.shm.cross_memory import CrossMemory

    world = SharedWorld(2, staging_bytes=4096, heap_bytes=128 << 20)
    for transport in world.transports:
        transport.cross_memory = CrossMemory([os.getpid()] * 2)
    sources = Sources(world, 2, kind)
    cases = []
    for count in (COOPERATIVE_BYTES, COOPERATIVE_BYTES + 4097, 3 * COOPERATIVE_BYTES + 1):
        for root in (0, 1):
            bufs = sources.make(count, np.dtype(np.uint8), [count + root, 7 * count + root])
            cases.append((bufs, root, bufs[root].copy()))
    staged_before = [t.progress_of(1 - t.rank, t.epoch) for t in world.transports]

    def body(transport):
        for bufs, root, _ in cases:
            get_algorithm("shm_direct", "broadcast")(transport, bufs[transport.rank], root, segment_bytes=1 << 20)

    rooted = []  # scatter and gather: (whole, parts, root), checked both ways
    for count in (COOPERATIVE_BYTES // 2, COOPERATIVE_BYTES + 4097):
        for root in (0, 1):
            whole = sources.make(2 * count, np.dtype(np.uint8), [3 * count + root, 5 * count + root])
            parts = sources.make(count, np.dtype(np.uint8), [11 * count + root, 13 * count + root])
            rooted.append((whole, parts, root, whole[root].copy(), [part.copy() for part in parts]))

    def scatter_and_gather(transport):
        rank = transport.rank
        for whole, parts, root, _, _ in rooted:
            scatter_out = np.zeros(parts[rank].size, np.uint8)
            get_algorithm("shm_direct", "scatter")(transport, scatter_out, whole[rank] if rank == root else None,
                                                   root, segment_bytes=1 << 20)
            parts.append((rank, scatter_out))
            gathered = np.zeros(whole[rank].size, np.uint8) if rank == root else None
            get_algorithm("shm_direct", "gather")(transport, gathered, parts[rank], root, segment_bytes=1 << 20)
            if rank == root:
                parts.append(("gathered", gathered))

    world.run(body)
    world.run(scatter_and_gather)
    for bufs, root, sent in cases:
        for rank in range(2):
            assert bufs[rank].tobytes() == sent.tobytes(), (kind, bufs[rank].size, root, rank)
    for _, parts, root, sent_whole, sent_parts in rooted:
        results = dict(parts[2:])
        count = sent_parts[0].size
        for rank in range(2):
            assert results[rank].tobytes() == sent_whole[rank * count:(rank + 1) * count].tobytes(), (kind, root, rank)
        assert results["gathered"].tobytes() == np.concatenate(sent_parts).tobytes(), (kind, root)
    # One epoch per call, and no chunk ever staged (PROGRESS untouched).
    assert all(t.epoch == len(cases) + 2 * len(rooted) for t in world.transports)
    assert [t.progress_of(1 - t.rank, t.epoch) for t in world.transports] == staged_before == [0, 0]


def test_a_cross_memory_copy_that_fails_names_the_peer_and_the_cause():
    from commlib import CommError
    from commlib.shm.cross_memory import CrossMemory

    cross = CrossMemory([os.getpid(), os.getpid()], describe_peer=lambda peer: f"rank {peer} (here)")
    source = np.arange(64, dtype=np.uint8)
    target = np.zeros(64, np.uint8)
    cross.read(1, source.ctypes.data, target)  # this process's own memory: allowed
    assert target.tobytes() == source.tobytes()
    with pytest.raises(CommError, match=r"cross-memory read from rank 1 \(here\) failed after 0 of 64 bytes"):
        cross.read(1, 8, target)  # an address nothing is mapped at: EFAULT
