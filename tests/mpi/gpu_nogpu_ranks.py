"""PYTHONPATH=. mpiexec -n P python tests/mpi/gpu_nogpu_ranks.py

The parts of commlib.gpu that need no GPU, under real MPI at any world size:

* the preflight: fabricated per-rank GPU records are exchanged over MPI (the real Iallgather)
  and every rank runs the decision on what it received: duplicate GPUs, NCCL version mismatch,
  ranks without a GPU, bad explicit devices, disagreeing transports -> the same error on every
  rank, naming the ranks at fault;
* the whole group path for a "CuPy array" on ranks without a GPU (a stand-in object, since CuPy
  arrays cannot exist here): every rank raises the same InvalidUsageError naming the ranks, and
  the group's CPU collectives keep working;
* the host-staged transport with a numpy stager (host "device"): its natives and point-to-point
  steps, and every registered algorithm of every collective run through it.
"""


import numpy as np

import commlib
from commlib import InvalidUsageError, ReduceOp
from commlib.algorithms.registry import algorithm_names, get_algorithm
from commlib.gpu.device import LocalGpus
from commlib.gpu.preflight import GpuSetupError, RankRecord, decide, exchange_records
from commlib.transports.host_staged import HostStagedTransport
from tests.support.closed_form import small_values
from tests.support.verdict import Checker

NCCL_2_28 = 22805


def gpus(host, uuids, nccl=NCCL_2_28, problem=""):
    return LocalGpus(host, list(uuids), nccl, "14.2.0", problem)


def outcome(comm, record):
    """Exchange over MPI, then decide; returns the devices or the GpuSetupError."""
    records = exchange_records(comm, record, timeout=30)
    try:
        return decide(records)
    except GpuSetupError as exc:
        return exc


def ranks_text(ranks):
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def check_preflight(check, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    everyone = list(range(size))

    # One host, one GPU per rank: devices are the local ranks.
    result = outcome(comm, RankRecord(rank, "nccl", None, gpus("n0", [f"GPU-{i:032x}" for i in range(size)])))
    check.check(result == everyone, f"distinct GPUs: expected devices {everyone}, got {result!r}")

    # One host, one GPU: every rank maps to device 0.
    result = outcome(comm, RankRecord(rank, "nccl", None, gpus("n0", ["GPU-" + "ab" * 16])))
    if size == 1:
        check.check(result == [0], f"single rank on one GPU: got {result!r}")
    else:
        check.check(isinstance(result, GpuSetupError) and f"{ranks_text(everyone)} on host n0" in str(result)
                    and "Duplicate GPU" in str(result) and "host_staged" in str(result),
                    f"duplicate GPU on one host: expected an error naming {ranks_text(everyone)}, got {result!r}")

    # The same, host-staged: sharing a GPU is the point.
    result = outcome(comm, RankRecord(rank, "host_staged", None, gpus("n0", ["GPU-" + "ab" * 16])))
    check.check(result == [0] * size, f"host-staged on one GPU: expected all device 0, got {result!r}")

    # Two hosts (ranks alternate), one GPU each, distinct UUIDs: only ranks on the same host collide.
    host = f"n{rank % 2}"
    result = outcome(comm, RankRecord(rank, "nccl", None, gpus(host, [f"GPU-{rank % 2:032x}"])))
    colliding = [[r for r in everyone if r % 2 == h] for h in (0, 1)]
    colliding = [c for c in colliding if len(c) > 1]
    if not colliding:
        check.check(result == [0] * size, f"two hosts, no collision: got {result!r}")
    else:
        text = str(result)
        check.check(isinstance(result, GpuSetupError)
                    and all(f"{ranks_text(c)} on host n{c[0] % 2}" in text for c in colliding),
                    f"two hosts: expected an error naming {colliding}, got {result!r}")

    # PCI-bus-id fallback: the same id on two hosts is two GPUs.
    result = outcome(comm, RankRecord(rank, "nccl", None, gpus(f"h{rank}", ["PCI-0000:01:00.0"])))
    check.check(result == [0] * size, f"PCI ids on distinct hosts: got {result!r}")

    # NCCL version mismatch on the last rank.
    version = 22703 if rank == size - 1 and size > 1 else NCCL_2_28
    result = outcome(comm, RankRecord(rank, "nccl", None, gpus(f"h{rank}", [f"GPU-{rank:032x}"], nccl=version)))
    if size == 1:
        check.check(result == [0], f"one rank, one version: got {result!r}")
    else:
        text = str(result)
        check.check(isinstance(result, GpuSetupError) and f"NCCL 2.27.3 on rank {size - 1}" in text
                    and f"NCCL 2.28.5 on {ranks_text(everyone[:-1])}" in text,
                    f"version mismatch: got {result!r}")

    # The same UUID seen from two hosts is one GPU (UUIDs are global): still a duplicate.
    result = outcome(comm, RankRecord(rank, "nccl", None, gpus(f"h{rank}", ["GPU-" + "cd" * 16])))
    if size > 1:
        check.check(isinstance(result, GpuSetupError) and "would all use GPU 0" in str(result),
                    f"one UUID on two hosts: got {result!r}")

    # A rank without a GPU (the last one): everyone names it, nobody waits for it.
    broken = size - 1
    record = gpus(f"h{rank}", [] if rank == broken else ["GPU-" + "ef" * 16],
                  problem="cupy is not installed" if rank == broken else "")
    result = outcome(comm, RankRecord(rank, "nccl", None, record))
    check.check(isinstance(result, GpuSetupError) and "rank without a usable GPU" in str(result)
                and f"rank {broken} on h{broken}: cupy is not installed" in str(result),
                f"rank without GPU: got {result!r}")

    # An explicit device out of range on rank 0.
    result = outcome(comm, RankRecord(rank, "host_staged", 5 if rank == 0 else None,
                                      gpus("n0", ["GPU-" + "12" * 16, "GPU-" + "34" * 16])))
    check.check(isinstance(result, GpuSetupError) and "rank 0: device=5 out of range" in str(result),
                f"explicit device out of range: got {result!r}")
    # Explicit devices that make NCCL ranks share a GPU.
    result = outcome(comm, RankRecord(rank, "nccl", 1, gpus("n0", ["GPU-" + "12" * 16, "GPU-" + "34" * 16])))
    if size > 1:
        check.check(isinstance(result, GpuSetupError) and "would all use GPU 1" in str(result),
                    f"explicit devices colliding: got {result!r}")

    # Ranks that disagree on the transport.
    kind = "host_staged" if rank == 0 else "nccl"
    result = outcome(comm, RankRecord(rank, kind, None, gpus(f"h{rank}", ["GPU-" + "56" * 16])))
    if size > 1:
        check.check(isinstance(result, GpuSetupError) and "host_staged on rank 0" in str(result),
                    f"transport disagreement: got {result!r}")


class StandInCupyArray:
    """Quacks like a cupy.ndarray for the group's validation (CuPy cannot be imported here)."""

    __module__ = "cupy._core.core"

    def __init__(self, array):
        self._array = array
        for name in ("flags", "dtype", "shape", "nbytes", "size", "strides"):
            setattr(self, name, getattr(array, name))

    def reshape(self, *shape):
        return StandInCupyArray(self._array.reshape(*shape))


def check_no_gpu_group_path(check, pg):
    size = pg.size
    fake = StandInCupyArray(np.ones(8, dtype=np.float32))
    expected = f"rank {pg.rank} on "
    for attempt in ("first", "second"):
        error = check.raises(InvalidUsageError, lambda: pg.allreduce(fake), f"{attempt} GPU call without a GPU")
        if error is not None:
            check.check("a CuPy array on a rank without a usable GPU" in str(error) and expected in str(error)
                        and "cupy is not installed" in str(error), f"message: {error}")
    # Not poisoned: the ranks agreed, so CPU collectives go on.
    buf = np.full(5, pg.rank + 1, dtype=np.int64)
    pg.allreduce(buf)
    check.equal(buf, np.full(5, size * (size + 1) // 2), "CPU allreduce after the GPU setup error")


class NumpyStager:
    """The host-staged transport's device side, played by numpy arrays (copies, like D2H/H2D)."""

    xp = np

    def to_host(self, dev):
        return dev.copy()

    def host_empty(self, dev):
        return np.empty(dev.size, dtype=dev.dtype)

    def to_device(self, dev, host):
        dev[...] = host


def check_host_staged(check, comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    transport = HostStagedTransport(comm, NumpyStager())
    ctx = transport.context
    seq = [0]

    def begin(name):
        seq[0] += 1
        ctx.begin(name, seq[0], "native", 0, 30.0)

    stacked = lambda count, dtype: np.stack([small_values(r, count, np.float64) for r in range(size)])  # noqa: E731
    for count in sorted({0, 1, size, 7 * size + 3}):
        for dtype in ("float32", "int64"):
            begin("allreduce")
            buf = small_values(rank, count, dtype)
            transport.native_allreduce(buf, ReduceOp.SUM)
            check.equal(buf, stacked(count, dtype).sum(0).astype(dtype), f"native allreduce n={count} {dtype}")

            begin("broadcast")
            root = size - 1
            buf = small_values(rank, count, dtype)
            transport.native_broadcast(buf, root)
            check.equal(buf, small_values(root, count, dtype), f"broadcast n={count} {dtype}")

            begin("reduce")
            buf = small_values(rank, count, dtype)
            transport.native_reduce(buf, 0, ReduceOp.MAX)
            if rank == 0:
                check.equal(buf, stacked(count, dtype).max(0).astype(dtype), f"reduce n={count} {dtype}")
            else:
                check.equal(buf, small_values(rank, count, dtype), f"reduce leaves non-root n={count}")

            begin("allgather")
            out = np.empty(count * size, dtype=dtype)
            transport.native_allgather(out, small_values(rank, count, dtype))
            check.equal(out, stacked(count, dtype).reshape(-1).astype(dtype), f"allgather n={count} {dtype}")

            begin("reduce_scatter")
            inp = small_values(rank, count * size, dtype)
            out = np.empty(count, dtype=dtype)
            transport.native_reduce_scatter(out, inp, ReduceOp.SUM)
            full = stacked(count * size, dtype).sum(0).astype(dtype)
            check.equal(out, full[rank * count:(rank + 1) * count], f"reduce_scatter n={count} {dtype}")

    # One ring step through post(): send to the right, receive from the left, two slices at once.
    begin("ring_step")
    data = small_values(rank, 10, np.float64)
    left = np.empty(10)
    right, from_ = (rank + 1) % size, (rank - 1) % size
    pending = transport.post(sends=[(data[:4], right), (data[4:], right)],
                             recvs=[(left[:4], from_), (left[4:], from_)])
    pending.wait()
    check.equal(left, small_values(from_, 10, np.float64), "post(): ring step")

    # Every registered allreduce algorithm that moves bytes through a transport's messages (the
    # shared-memory ones read host memory of the peers directly: no GPU buffer gets there).
    for name in algorithm_names():
        fn = get_algorithm(name)
        if getattr(fn, "requires_shared_memory", False):
            continue
        for count in (1, 4 * size + 1, 1000):
            begin("allreduce")
            buf = small_values(rank, count, np.int32)
            fn(transport, buf, ReduceOp.SUM, segment_bytes=64)
            check.equal(buf, stacked(count, np.int32).sum(0).astype(np.int32), f"{name} via host staging n={count}")
    check_every_collective_host_staged(check, transport, begin, rank, size)
    transport.close()


def check_every_collective_host_staged(check, transport, begin, rank, size):
    """Every algorithm of every other collective runs unchanged over the host-staged transport."""
    def each(collective):
        for name in algorithm_names(collective):
            fn = get_algorithm(name, collective)
            if getattr(fn, "requires_shared_memory", False):
                continue  # reads the peers' host memory directly (shm_direct): no GPU buffer gets there
            begin(collective)
            yield name, fn

    block, root = 3, size - 1
    whole = np.concatenate([small_values(r, block, np.int32) for r in range(size)])
    for name, fn in each("broadcast"):
        buf = small_values(rank, 7, np.int32)
        fn(transport, buf, root, segment_bytes=8)
        check.equal(buf, small_values(root, 7, np.int32), f"broadcast {name} via host staging")
    for name, fn in each("reduce"):
        buf = small_values(rank, 7, np.int32)
        fn(transport, buf, root, ReduceOp.SUM, segment_bytes=8)
        expected = (sum(small_values(r, 7, np.int64) for r in range(size)) if rank == root
                    else small_values(rank, 7, np.int64))
        check.equal(buf, expected.astype(np.int32), f"reduce {name} via host staging")
    for name, fn in each("allgather"):
        out = np.empty(block * size, np.int32)
        fn(transport, out, small_values(rank, block, np.int32), segment_bytes=8)
        check.equal(out, whole, f"allgather {name} via host staging")
    for name, fn in each("reduce_scatter"):
        out = np.empty(block, np.int32)
        fn(transport, out, np.tile(small_values(rank, block, np.int32), size), ReduceOp.SUM, segment_bytes=8)
        check.equal(out, sum(small_values(r, block, np.int64) for r in range(size)).astype(np.int32),
                    f"reduce_scatter {name} via host staging")
    for name, fn in each("alltoall"):
        out = np.empty(block * size, np.int32)
        fn(transport, out, np.tile(small_values(rank, block, np.int32), size), segment_bytes=8)
        check.equal(out, whole, f"alltoall {name} via host staging")
    for name, fn in each("alltoallv"):
        counts = tuple([block] * size)
        out = np.empty(block * size, np.int32)
        fn(transport, out, np.tile(small_values(rank, block, np.int32), size), counts, counts, segment_bytes=8)
        check.equal(out, whole, f"alltoallv {name} via host staging")
    for name, fn in each("gather"):
        out = np.empty(block * size, np.int32) if rank == root else None
        fn(transport, out, small_values(rank, block, np.int32), root, segment_bytes=8)
        if rank == root:
            check.equal(out, whole, f"gather {name} via host staging")
    for name, fn in each("scatter"):
        out = np.empty(block, np.int32)
        fn(transport, out, whole.copy() if rank == root else None, root, segment_bytes=8)
        check.equal(out, small_values(rank, block, np.int32), f"scatter {name} via host staging")
    for name, fn in each("barrier"):
        fn(transport, segment_bytes=8)
        check.check(True, f"barrier {name} via host staging")


def main():
    pg = commlib.init(timeout=60)
    check = Checker()
    comm = pg.comm.Dup()
    check_preflight(check, comm)
    check_no_gpu_group_path(check, pg)
    check_host_staged(check, comm)
    comm.Free()
    check.finish()


if __name__ == "__main__":
    main()
