"""torchrun --nproc-per-node P tests/launch/launch_ranks.py MODE[,MODE...]     (the repo root on PYTHONPATH)

A rank of a job launched without MPI (torchrun, or tests/support/launch.py's run_ranks: torch's
variables, no MPI launcher). Modes separated by commas run one after the other in the same
processes (each starts and ends its own groups). MODE:

* ``collectives``: every collective with every registered algorithm (and ``auto``), dtypes and odd
  sizes, against closed forms; async; a sub-group; symmetric buffers; a bad call raises before
  anything is sent; the world's topology and transport; MPI never initialised;
* ``debug``: with COMMLIB_DEBUG=1 the ranks call different collectives: every rank raises
  CollectiveMismatchError naming both;
* ``torch``: the "commlib" backend under the launcher: collectives, new_group, DeviceMesh/DTensor,
  torch DDP bitwise equal to the same DDP over gloo;
* ``kill``: rank 1 dies (SIGKILL) inside a large allreduce; the others end in PeerExitedError
  naming it, and print how long after its death;
* ``skip``: rank 1 skips a collective; the others time out naming it (COMMLIB_TIMEOUT short);
* ``restart``: under torchrun --max-restarts 1: the first attempt's rank 1 exits with 3, the second
  attempt runs clean;
* ``init``: init and one barrier (the bad-launch tests vary the variables around it);
* ``p2p``: the ``commlib.init()`` group's point-to-point channel over sockets passes every check
  of :mod:`tests.support.p2p_checks` (send/recv/isend/irecv, ANY_SOURCE, out of order, large and
  unexpected messages, errors named, the monitored barrier), apart from the group's collectives;
  and in a sub-group;
* ``hostile``: (tests/multihost/test_hostile_multihost.py) each rank writes
  ``$HOSTILE_DIR/rank{r}.json`` (pid, host, the witness's endpoint, the store's port), then runs
  allreduces with closed forms until ``$HOSTILE_DIR/stop`` exists, while a stranger attacks;
* ``p2p_torch``: ``dist.send/recv/isend/irecv`` (``src=None``: any source), ``batch_isend_irecv``,
  ``dist.barrier`` and the monitored barrier on the "commlib" backend, closed-form payloads.

A failed check raises, so the rank exits non-zero (a launcher then ends the others; they never
wait for it forever: its sockets close). Each rank prints one line per event, written whole.
"""

import faulthandler
import os
import signal
import sys
import time

import numpy as np

import commlib
from commlib import CollectiveMismatchError, CommTimeoutError, InvalidUsageError, PeerExitedError, ReduceOp

DTYPES = (np.float32, np.int64, np.float64)


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write per line: ranks' lines never interleave
    sys.stdout.flush()


def values(rank: int, count: int, dtype) -> np.ndarray:
    return ((np.arange(count) + rank) % 3 + 1).astype(dtype)


def stacked(size: int, count: int) -> np.ndarray:
    return np.stack([values(r, count, np.float64) for r in range(size)])


class Checks:
    def __init__(self, rank: int):
        self.rank, self.count = rank, 0

    def equal(self, got, expected, what: str) -> None:
        self.count += 1
        got, expected = np.asarray(got, np.float64).reshape(-1), np.asarray(expected, np.float64).reshape(-1)
        if got.shape != expected.shape or not np.allclose(got, expected, rtol=1e-6):
            if got.shape != expected.shape:
                raise AssertionError(f"rank {self.rank}: {what}: shape {got.shape}, expected {expected.shape}")
            bad = int(np.argmax(~np.isclose(got, expected)))
            raise AssertionError(f"rank {self.rank}: {what}: index {bad}: expected {expected[bad]}, got {got[bad]}")

    def true(self, condition: bool, what: str) -> None:
        self.count += 1
        if not condition:
            raise AssertionError(f"rank {self.rank}: {what}")


def algorithms(pg, collective: str):
    """``auto`` and every registered algorithm (the shared-memory ones only within one host)."""
    return ["auto"] + [name for name in commlib.algorithms(collective)
                       if not (name.startswith("shm_") and pg.topology.spans_hosts)]


def sweep(pg, check: Checks) -> None:
    rank, size = pg.rank, pg.size
    counts = sorted({0, 1, size + 1, 1001})
    ops = (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN)
    for algorithm in algorithms(pg, "allreduce"):
        for dtype in DTYPES:
            for op in ops:
                for count in counts:
                    buf = values(rank, count, dtype)
                    pg.allreduce(buf, op, algorithm=algorithm)
                    expected = {ReduceOp.SUM: stacked(size, count).sum(0), ReduceOp.MAX: stacked(size, count).max(0),
                                ReduceOp.MIN: stacked(size, count).min(0)}[op]
                    check.equal(buf, expected, f"allreduce {algorithm} {np.dtype(dtype).name} {op.name} n={count}")
    for algorithm in algorithms(pg, "broadcast"):
        for count in counts:
            for root in sorted({0, size - 1}):
                buf = values(rank, count, np.float32)
                pg.broadcast(buf, root, algorithm=algorithm)
                check.equal(buf, values(root, count, np.float64), f"broadcast {algorithm} root {root} n={count}")
    for algorithm in algorithms(pg, "reduce"):
        for count in counts:
            buf = values(rank, count, np.float64)
            pg.reduce(buf, size - 1, algorithm=algorithm)
            expected = stacked(size, count).sum(0) if rank == size - 1 else values(rank, count, np.float64)
            check.equal(buf, expected, f"reduce {algorithm} n={count}")
    for algorithm in algorithms(pg, "allgather"):
        for count in counts:
            out = np.empty(size * count, np.int64)
            pg.allgather(out, values(rank, count, np.int64), algorithm=algorithm)
            check.equal(out, stacked(size, count).reshape(-1), f"allgather {algorithm} n={count}")
    for algorithm in algorithms(pg, "reduce_scatter"):
        for count in counts:
            out = np.empty(count, np.float64)
            pg.reduce_scatter(out, values(rank, size * count, np.float64), algorithm=algorithm)
            whole = stacked(size, size * count).sum(0)
            check.equal(out, whole[rank * count:(rank + 1) * count], f"reduce_scatter {algorithm} n={count}")
    for algorithm in algorithms(pg, "alltoall"):
        for count in counts:
            inp = (np.arange(size * count) + 100 * rank).astype(np.int64)
            out = np.empty_like(inp)
            pg.alltoall(out, inp, algorithm=algorithm)
            expected = np.concatenate([np.arange(rank * count, (rank + 1) * count) + 100 * src for src in range(size)])
            check.equal(out, expected, f"alltoall {algorithm} n={count}")
    for algorithm in algorithms(pg, "alltoallv"):
        in_counts = [(rank + peer) % 3 for peer in range(size)]
        out_counts = [(src + rank) % 3 for src in range(size)]
        inp = np.full(sum(in_counts), rank, np.int64)
        out = np.empty(sum(out_counts), np.int64)
        pg.alltoallv(out, inp, out_counts, in_counts, algorithm=algorithm)
        check.equal(out, np.repeat(np.arange(size), out_counts), f"alltoallv {algorithm}")
    for algorithm in algorithms(pg, "gather"):
        out = np.empty(size * 5, np.float32) if rank == 0 else None
        pg.gather(out, values(rank, 5, np.float32), 0, algorithm=algorithm)
        if rank == 0:
            check.equal(out, stacked(size, 5).reshape(-1), f"gather {algorithm}")
    for algorithm in algorithms(pg, "scatter"):
        out = np.empty(5, np.float32)
        inp = stacked(size, 5).reshape(-1).astype(np.float32) if rank == 0 else None
        pg.scatter(out, inp, 0, algorithm=algorithm)
        check.equal(out, values(rank, 5, np.float64), f"scatter {algorithm}")
    for algorithm in algorithms(pg, "barrier"):
        pg.barrier(algorithm=algorithm)
    works = [pg.allreduce(np.full(100, rank + 1, np.float32), async_op=True) for _ in range(4)]
    for work in works:
        check.equal(work.result(), np.full(100, size * (size + 1) / 2), "async allreduce")


def collectives() -> None:
    pg = commlib.init(timeout=60)
    rank, size = pg.rank, pg.size
    check = Checks(rank)
    from mpi4py import MPI

    check.true(not MPI.Is_initialized(), "MPI initialised in a job launched without it")
    check.true(type(pg.transport).__name__ == "SocketTransport", f"world transport {type(pg.transport).__name__}")
    hosts = size // int(os.environ.get("LOCAL_WORLD_SIZE", size))
    check.true(pg.topology.host_count == hosts and pg.prefers_symmetric_buffers == (size > 1 and hosts == 1),
               f"topology {pg.topology.describe()}, symmetric {pg.prefers_symmetric_buffers}, expected {hosts} hosts")
    sweep(pg, check)
    if size > 1 and hosts == 1:  # symmetric buffers: the shared-memory schedules read the peers' memory in place
        sym = pg.alloc(4096, np.float32)
        for algorithm in ("auto", "shm_oneshot", "shm_twoshot"):
            sym[...] = rank + 1
            pg.allreduce(sym, algorithm=algorithm)
            check.equal(sym, np.full(4096, size * (size + 1) / 2), f"symmetric allreduce {algorithm}")
    sub = pg.new_group(list(range(size))[::-1])  # every rank, reversed: rank r is rank size-1-r there
    check.true(sub is not None and sub.rank == size - 1 - rank, f"sub-group rank {sub and sub.rank}")
    buf = np.full(10, rank, np.float64)
    sub.allreduce(buf, ReduceOp.MAX)
    check.equal(buf, np.full(10, size - 1), "sub-group allreduce")
    before = pg.seq
    try:
        pg.allgather(np.empty(3, np.float32), np.empty(2, np.float32))
        check.true(False, "a wrong allgather did not raise")
    except InvalidUsageError:
        check.true(pg.seq == before, "a refused call took a sequence number")
    say(f"rank {rank}: pid {os.getpid()}")  # its shared-memory files carry it: see test_launch.py
    say(f"rank {rank}: {check.count} checks OK")
    commlib.shutdown()


def debug() -> None:
    pg = commlib.init(timeout=30, debug=True)
    try:
        if pg.rank == 0:
            pg.broadcast(np.ones(4, np.float32), 0)
        else:
            pg.allreduce(np.ones(4, np.float32))
        raise AssertionError(f"rank {pg.rank}: different collectives did not raise")
    except CollectiveMismatchError as error:
        if "broadcast" not in str(error) or "allreduce" not in str(error):
            raise
        say(f"rank {pg.rank}: mismatch named: {str(error)[:200]}")


def torch_backend() -> None:
    import torch
    import torch.distributed as dist

    import autograd_bridge  # noqa: F401  # registers the backend

    dist.init_process_group("commlib")
    rank, size = dist.get_rank(), dist.get_world_size()
    check = Checks(rank)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    check.equal(t.numpy(), np.full(1000, size * (size + 1) / 2), "all_reduce")
    pair = dist.new_group([0, 1])
    if rank < 2:
        u = torch.ones(3)
        dist.all_reduce(u, group=pair)
        check.equal(u.numpy(), np.full(3, 2), "new_group all_reduce")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (size,))
    full = distribute_tensor(torch.arange(8.0 * size).reshape(-1, 2), mesh, [Shard(0)]).full_tensor()
    check.equal(full.numpy(), np.arange(8.0 * size), "DTensor full_tensor")
    gloo = dist.new_group(backend="gloo")
    models = []
    for group in (None, gloo):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        model = torch.nn.parallel.DistributedDataParallel(net, process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(rank)
        for _ in range(3):
            optimizer.zero_grad()
            model(torch.randn(8, 16, generator=data)).square().mean().backward()
            optimizer.step()
        models.append([p.detach().clone() for p in model.parameters()])
    check.true(all(torch.equal(a, b) for a, b in zip(*models)), "DDP on commlib is not bitwise DDP on gloo")
    say(f"rank {rank}: {check.count} checks OK")
    dist.destroy_process_group()
    # torch's own teardown deadlocks now and then (measured: 2 runs in 3 under load): freeing the
    # gloo DDP model frees ProcessGroupGloo, whose destructor joins its worker threads holding the
    # GIL while a worker waits for the GIL to free its last work's thread-local state. The gloo
    # group is only the reference here, so it is never freed: the rank ends without teardown
    # (pytorch/pytorch#56297: the Reducer is freed holding the GIL).
    KEPT_ALIVE.extend([gloo, model])
    sys.stdout.flush()
    os._exit(0)


KEPT_ALIVE: list = []


def kill() -> None:
    pg = commlib.init(timeout=60)
    mark = os.environ["DEATH_FILE"]
    pg.barrier()
    if pg.rank == 1:
        with open(mark, "w") as handle:
            handle.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    buf = np.ones(int(os.environ.get("KILL_ELEMENTS", 16 << 20)), np.float32)
    try:
        for _ in range(50):
            pg.allreduce(buf)
        raise AssertionError(f"rank {pg.rank}: allreduce went on without rank 1")
    except PeerExitedError as error:
        elapsed = time.time() - float(open(mark).read())
        if "rank 1" not in str(error):
            raise
        say(f"rank {pg.rank}: PeerExitedError {elapsed:.3f} s after rank 1 died: {str(error)[:200]}")


def skip() -> None:
    pg = commlib.init()
    if pg.rank != 1:
        started = time.monotonic()
        try:
            pg.allreduce(np.ones(1 << 16, np.float32))
            raise AssertionError(f"rank {pg.rank}: allreduce completed without rank 1")
        except CommTimeoutError as error:
            say(f"rank {pg.rank}: CommTimeoutError after {time.monotonic() - started:.1f} s: {str(error)[:300]}")
    else:
        time.sleep(pg.timeout + 5)


def restart() -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    pg = commlib.init(timeout=60)
    buf = np.full(100, pg.rank, np.float64)
    pg.allreduce(buf)
    if attempt == 0 and pg.rank == 1:
        say(f"rank 1: attempt {attempt}: failing on purpose")
        sys.exit(3)
    if attempt == 0:
        pg.barrier()  # waits for rank 1, which is gone: the attempt fails here, as a real job would
    say(f"rank {pg.rank}: attempt {attempt}: sum {buf[0]:g} OK")
    commlib.shutdown()


def init_only() -> None:
    pg = commlib.init()
    pg.barrier()
    say(f"rank {pg.rank}: joined a world of {pg.size}")
    commlib.shutdown()


def p2p() -> None:
    from tests.support import p2p_checks
    from tests.support.verdict import LocalChecker

    pg = commlib.init(timeout=60)
    rank, size = pg.rank, pg.size
    check = LocalChecker(rank)
    check.check(type(pg.p2p).__name__ == "SocketPointToPoint", f"the world's p2p channel is {pg.p2p!r}")
    side = pg.new_group(list(range(size)))  # its barrier: a sync outside the world's collectives and channel
    assert side is not None
    sync = side.barrier
    seq = pg.seq
    p2p_checks.check_blocking_and_nonblocking(check, pg)
    check.check(pg.seq == seq, f"send/recv took {pg.seq - seq} collective numbers")
    p2p_checks.check_out_of_order_and_large(check, pg, sync)
    p2p_checks.check_any_source(check, pg, sync)
    p2p_checks.check_separate_from_collectives(check, pg, sync)
    p2p_checks.check_blocked_recv_does_not_stall_the_comm_thread(check, pg)
    p2p_checks.check_errors(check, pg, sync)
    buf = np.ones(3)
    pg.allreduce(buf)
    check.equal(buf, np.full(3, float(size)), "allreduce after point-to-point errors")
    p2p_checks.check_monitored_barrier(check, pg, sync)
    sub = pg.new_group(list(range(size))[::-1])  # a sub-group's channel is its own, its ranks renumbered
    assert sub is not None
    check.check(sub.p2p is not None and sub.p2p is not pg.p2p, "the sub-group has a channel of its own")
    p2p_checks.check_blocking_and_nonblocking(check, sub)
    p2p_checks.check_any_source(check, sub, side.barrier)
    sub.monitored_barrier(timeout=30)
    commlib.shutdown()
    checks, failures = check.finish()
    if failures:
        raise AssertionError(f"rank {rank}: {len(failures)} of {checks} checks failed: " + "; ".join(failures[:5]))
    say(f"rank {rank}: {checks} checks OK")


def p2p_torch() -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import autograd_bridge  # noqa: F401  # registers the backend

    dist.init_process_group("commlib")
    rank, size = dist.get_rank(), dist.get_world_size()
    check = Checks(rank)
    right, left = (rank + 1) % size, (rank - 1) % size

    def payload(src: int, dst: int, count: int, dtype, tag: int = 0):
        return torch.from_numpy(((np.arange(count) * 3 + src * 11 + dst * 5 + tag) % 113).astype(np.float64)).to(dtype)

    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):
        for count in (0, 1, 1000, 300_000):  # 300k: above the eager limit for every dtype but uint8
            got = torch.full((count,), 99, dtype=dtype)
            if rank % 2 == 0:  # blocking both ways without deadlock: evens send first
                dist.send(payload(rank, right, count, dtype, 3), right, tag=3)
                dist.recv(got, left, tag=3)
            else:
                dist.recv(got, left, tag=3)
                dist.send(payload(rank, right, count, dtype, 3), right, tag=3)
            check.true(torch.equal(got, payload(left, rank, count, dtype, 3)), f"send/recv {dtype} n={count}")
    sends = [dist.isend(payload(rank, right, 50 + tag, torch.float64, tag), right, tag=tag) for tag in range(10)]
    recvs = [(torch.empty(50 + tag, dtype=torch.float64), tag) for tag in range(10)]
    works = [dist.irecv(buf, left, tag=tag) for buf, tag in recvs]
    for work, (buf, tag) in reversed(list(zip(works, recvs))):  # waited in reverse
        work.wait()
        check.true(torch.equal(buf, payload(left, rank, 50 + tag, torch.float64, tag)), f"irecv tag {tag}")
    for work in sends:
        work.wait()
    if rank == 0:  # src=None: any source; recv returns the sender
        senders = []
        for _ in range(size - 1):
            buf = torch.empty(4, dtype=torch.int32)
            sender = dist.recv(buf, None, tag=11)
            senders.append(sender)
            check.true(torch.equal(buf, torch.full((4,), sender * 7, dtype=torch.int32)), f"from {sender}")
        check.true(sorted(senders) == list(range(1, size)), f"any-source senders {senders}")
    else:
        dist.send(torch.full((4,), rank * 7, dtype=torch.int32), 0, tag=11)
    inbox = torch.empty(6)
    ops = [dist.P2POp(dist.isend, payload(rank, right, 6, torch.float32), right),
           dist.P2POp(dist.irecv, inbox, left)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    check.true(torch.equal(inbox, payload(left, rank, 6, torch.float32)), "batch_isend_irecv ring")
    pair = dist.new_group([0, size - 1])  # global ranks, as torch names them
    if rank in (0, size - 1):
        t = torch.full((5,), float(rank))
        if rank == 0:
            dist.send(t, size - 1, group=pair, tag=2)
        else:
            dist.recv(t, 0, group=pair, tag=2)
            check.true(torch.equal(t, torch.zeros(5)), "send/recv in a sub-group")
    dist.barrier()
    backend = dist.distributed_c10d._get_default_group()  # torch's dist.monitored_barrier is gloo's only
    backend.monitored_barrier(datetime.timedelta(seconds=30))
    check.true(True, "monitored_barrier")
    if rank != size - 1:  # the last rank is late: rank 0 names it
        try:
            backend.monitored_barrier(datetime.timedelta(seconds=0.5))
            check.true(False, "a monitored barrier without the last rank passed")
        except CommTimeoutError as error:
            check.true(f"rank(s) {size - 1} did not arrive" in str(error), f"monitored_barrier said: {error}")
    dist.barrier()
    if rank == size - 1:
        try:
            backend.monitored_barrier(datetime.timedelta(seconds=0.5))
            check.true(False, "the late rank's monitored barrier passed")
        except CommTimeoutError:
            check.true(True, "the late rank was not released")
    dist.barrier()
    backend.monitored_barrier(datetime.timedelta(seconds=30))  # late tokens do not confuse the next one
    say(f"rank {rank}: {check.count} checks OK")
    dist.destroy_process_group()


def hostile() -> None:
    import json
    import socket

    from commlib.reliability.crash_witness import witness_endpoint

    pg = commlib.init(timeout=120)
    rank, size = pg.rank, pg.size
    check = Checks(rank)
    folder = os.environ["HOSTILE_DIR"]
    store_port = int(os.environ["MASTER_PORT"]) + 1 if rank == 0 else 0  # ours, beside torchrun's agent store
    # One buffer for the whole loop, refilled: a new 1 MiB array per call would make glibc's heap
    # grow (its mmap threshold adapts upward, then freed blocks fragment; measured over sockets:
    # +160 MB in 80,000 calls, then trimmed, and flat with MALLOC_MMAP_THRESHOLD_ fixed), which is
    # the test's allocator, not the job's memory. With it reused the ranks' RSS is flat, and asserted.
    big, done = np.empty(1 << 18, np.float32), np.zeros(1, np.int64)
    for _ in range(20):  # warm: the transport's scratch buffers and the allocator's first arenas
        big.fill(rank + 1)
        pg.allreduce(big)
        pg.allreduce(done, ReduceOp.MAX)
    with open(os.path.join(folder, f"rank{rank}.json.tmp"), "w") as handle:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "witness": witness_endpoint(),
                   "store_port": store_port}, handle)
    os.replace(os.path.join(folder, f"rank{rank}.json.tmp"), os.path.join(folder, f"rank{rank}.json"))
    deadline, calls = time.monotonic() + 300, 0
    expected = size * (size + 1) / 2
    while True:
        big.fill(rank + 1)
        pg.allreduce(big)
        # Every element is the closed form: min and max (no temporary arrays: see above).
        low, high = float(big.min()), float(big.max())
        check.true(low == high == expected, f"allreduce #{calls}: elements from {low} to {high}, expected {expected}")
        calls += 1
        done[0] = os.path.exists(os.path.join(folder, "stop"))
        pg.allreduce(done, ReduceOp.MAX)  # every rank stops after the same call
        if done[0]:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {rank}: the stop file never appeared")
    say(f"rank {rank}: {check.count} checks OK")
    commlib.shutdown()


MODES = {"collectives": collectives, "debug": debug, "torch": torch_backend, "kill": kill, "skip": skip,
         "restart": restart, "init": init_only, "p2p": p2p, "p2p_torch": p2p_torch,
         "hostile": hostile}

if __name__ == "__main__":
    if os.environ.get("COMMLIB_TEST_DUMP_AFTER"):
        # A hang prints every thread's stack before the test kills us (tests/support/launch.py).
        faulthandler.dump_traceback_later(float(os.environ["COMMLIB_TEST_DUMP_AFTER"]), exit=False)
    for mode in sys.argv[1].split(","):  # "p2p,p2p_torch": one after the other, one start of the ranks
        MODES[mode]()
