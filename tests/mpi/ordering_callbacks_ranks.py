"""PYTHONPATH=. mpiexec -n P python tests/mpi/ordering_callbacks_ranks.py

Collectives issued from completion callbacks keep one order on every rank (the rule in
commlib/execution/executor.py), however early or late each rank's collectives complete:

* our DDP with a hook that issues two dependent collectives per bucket, the second from the
  first's done-callback, several buckets in flight: bitwise equal to a serialized reference, to
  itself on repetition, and across ranks;
* a callback attached after later collectives were issued runs at its attach point on every rank,
  whether or not its collective had completed by then (rank 0 is made late on purpose);
* a callback that waits for a collective queued after it gets ``InvalidUsageError`` instead of a
  deadlock, through commlib's ``Work`` and through the torch backend's futures;
* a callback that raises poisons its group: that rank's next call raises ``GroupAbortedError``,
  the peers time out naming it.
"""

import math
import threading
import time


import numpy as np
import torch
import torch.distributed as dist

import autograd_bridge
import commlib
from commlib import CommTimeoutError, GroupAbortedError, InvalidUsageError, ReduceOp
from ddp import DistributedDataParallel as DDP
from tests.support.verdict import Checker

torch.set_num_threads(1)


def two_step_hook(wait_inline: bool):
    """Per bucket: allreduce the squared norm, then (from its callback) the bucket scaled by it."""
    def hook(_state, bucket):
        group, grads = bucket.process_group, bucket.array()
        norm_sq = np.array([float(np.dot(grads, grads))])
        future = torch.futures.Future()

        def scale_then_average(work):
            try:
                work.wait()
                grads[...] *= 1.0 / (1.0 + math.sqrt(norm_sq[0]))
                group.allreduce(grads, ReduceOp.AVG, async_op=True).wait()  # nested: done at once
                future.set_result(bucket.buffer())
            except Exception as exc:  # noqa: BLE001 - handed to the reducer through the future
                future.set_exception(exc)

        group.allreduce(norm_sq, async_op=True).add_done_callback(scale_then_average)
        if wait_inline:  # the serialized reference: the next bucket launches after this chain
            future.wait()
        return future
    return hook


def train_ddp(rank, wait_inline):
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(24, 24) for _ in range(6)]).double()
    model = DDP(net, bucket_cap_mb=0.004, first_bucket_cap_mb=0.004)
    model.register_comm_hook(None, two_step_hook(wait_inline))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(rank)
    for _ in range(8):
        optimizer.zero_grad()
        model(torch.randn(8, 24, generator=data, dtype=torch.float64)).pow(2).mean().backward()
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).numpy(), len(model.bucket_sizes())


def check_ddp_two_step_hook(check, pg):
    runs = [train_ddp(pg.rank, wait_inline=False) for _ in range(3)]
    reference, _ = train_ddp(pg.rank, wait_inline=True)
    first, buckets = runs[0]
    check.check(buckets >= 4, f"only {buckets} buckets: the check needs several in flight")
    for index, (params, _) in enumerate(runs[1:], start=2):
        check.equal(params, first, f"DDP two-step hook: repetition {index} vs 1")
    check.equal(first, reference, "DDP two-step hook: overlapped vs serialized")
    everyone = np.empty((pg.size, first.size))
    pg.allgather(everyone, first)
    for other in range(pg.size):
        check.equal(everyone[other], first, f"DDP two-step hook: rank {other} vs rank {pg.rank}")


def check_attach_point(check, pg):
    """A callback attached after later collectives were issued runs after them, on every rank."""
    rank, size = pg.rank, pg.size
    total = size * (size + 1) // 2  # sum over ranks of rank + 1
    seen = {}
    first = np.full(1000, rank + 1.0)
    second = np.full(1000, 10.0 * (rank + 1))
    w1 = pg.allreduce(first, async_op=True)
    w2 = pg.allreduce(second, async_op=True)
    if rank == 0:
        w2.wait()  # complete here before attaching; the peers attach while theirs may be pending
    from_callback = np.full(7, 100.0 * (rank + 1))

    def callback(work):
        seen["seq_at_callback"] = pg.seq
        seen["thread"] = threading.current_thread().name
        pg.allreduce(from_callback)

    w1.add_done_callback(callback)
    after = np.full(7, 1000.0 * (rank + 1))  # same shape: a swapped order would pair it wrongly
    pg.allreduce(after)
    w1.wait()
    check.equal(first, np.full(1000, float(total)), "first async allreduce")
    check.equal(second, np.full(1000, 10.0 * total), "second async allreduce")
    check.equal(from_callback, np.full(7, 100.0 * total), "allreduce issued from the late callback")
    check.equal(after, np.full(7, 1000.0 * total), "allreduce issued after attaching the callback")
    check.check(seen.get("thread", "").startswith("commlib-"), f"callback ran on {seen.get('thread')}")
    seqs = np.empty(size, np.int64)
    pg.allgather(seqs, np.array([seen["seq_at_callback"]], np.int64))
    check.equal(seqs, np.full(size, seqs[0]), "sequence number when the callback ran, across ranks")


def check_waiting_for_a_later_collective_raises(check, pg):
    holder, issued = {}, threading.Event()
    errors = []

    def callback(_work):
        issued.wait(30)
        try:
            holder["later"].wait()
        except InvalidUsageError as exc:
            errors.append(exc)

    pg.allreduce(np.ones(4), async_op=True).add_done_callback(callback)
    holder["later"] = pg.allreduce(np.ones(4), async_op=True)
    issued.set()
    holder["later"].wait()
    pg.barrier()  # the callback ran before the later collective
    check.check(len(errors) == 1 and "communication thread" in str(errors[0]),
                f"commlib Work: expected one InvalidUsageError, got {errors}")

    # The same through the torch backend: a future's callback waiting on a later all_reduce.
    holder.clear()
    issued.clear()
    a, b = torch.ones(4), torch.ones(4)

    def torch_callback(_future):
        issued.wait(30)
        return holder["later"].wait()

    chained = dist.all_reduce(a, async_op=True).get_future().then(torch_callback)
    holder["later"] = dist.all_reduce(b, async_op=True)
    issued.set()
    error = check.raises(Exception, chained.wait, "torch future callback waiting on a later all_reduce")
    if error is not None:
        check.check("communication thread" in str(error), f"torch future error: {error}")
    holder["later"].wait()
    check.equal(b.numpy(), np.full(4, float(pg.size)), "the later all_reduce still ran")


def check_raising_callback_poisons_the_group(check, pg):
    group = pg.new_group(list(range(pg.size)), timeout=2.0)
    work = group.allreduce(np.ones(4), async_op=True)
    if group.rank == 0:
        work.add_done_callback(lambda _work: 1 / 0)
    work.wait()
    if group.rank == 0:
        deadline = time.monotonic() + 10
        while group.executor.first_error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        check.raises(GroupAbortedError, lambda: group.allreduce(np.ones(4)), "call after a raising callback",
                     match="done-callback of allreduce")
    else:
        error = check.raises(CommTimeoutError, lambda: group.allreduce(np.ones(4)), "peer of the poisoned rank")
        if error is not None:
            check.check("rank 0" in str(error), f"the timeout names rank 0: {error}")


def main():
    autograd_bridge.init_process_group()
    pg = commlib.world()
    check = Checker()
    check_ddp_two_step_hook(check, pg)
    check_attach_point(check, pg)
    check_waiting_for_a_later_collective_raises(check, pg)
    if pg.size > 1:
        check_raising_callback_poisons_the_group(check, pg)
    dist.destroy_process_group()
    check.finish()


if __name__ == "__main__":
    main()
