"""PYTHONPATH=. mpiexec -n 3 python tests/mpi/torch_profiling_ranks.py

What torch's profiler records of the "commlib" backend's collectives, as it does of gloo's: one
event ``commlib:<collective>`` per call (gloo's ``gloo:<collective>``), async (it ends on the
communication thread), with the call's input shapes; and the call's results still exact under
the profiler, sync and async. Also DDP under the profiler (one ``commlib:all_reduce`` per
backward), point-to-point (``commlib:send``, ``commlib:recv``, ``commlib:recvAnySource``, async
even when a send completed in the caller's thread), and all_gather_coalesced in torch's layout
(``output_lists[rank][input]``).

Rank r contributes r + 1 (or a block derived from r), so every result is a closed form.
"""

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd import profiler

import autograd_bridge
import commlib
from tests.support.verdict import Checker

torch.set_num_threads(1)


def events_named(prof, title):
    return [e for e in prof.function_events if e.name == title]


def profiled(checker, what, title, shapes, call):
    """Run ``call()`` (returns a Work or None) under the profiler, waiting inside it; check the event."""
    with profiler.profile(record_shapes=True) as prof:
        work = call()
        if work is not None:
            work.wait()
    found = events_named(prof, title)
    if checker.check(len(found) == 1, f"{what}: {len(found)} events {title}, expected 1 "
                                      f"(seen: {sorted({e.name for e in prof.function_events})})"):
        event = found[0]
        checker.check(event.is_async, f"{what}: the event {title} is not async")
        checker.check(event.count == 1 and event.cpu_time >= 0, f"{what}: count {event.count}, cpu {event.cpu_time}")
        checker.check(event.input_shapes == shapes, f"{what}: input shapes {event.input_shapes}, expected {shapes}")


def check_collectives(checker, rank, size):
    everyone = sum(range(1, size + 1))
    for async_op in (False, True):
        mode = f"async_op={async_op}"
        t = torch.full((2, 3), float(rank + 1))
        profiled(checker, f"all_reduce {mode}", "commlib:all_reduce", [[2, 3]],
                 lambda t=t: dist.all_reduce(t, async_op=async_op))
        checker.equal(t.numpy(), np.full((2, 3), float(everyone)), f"all_reduce under the profiler {mode}")

        ts = [torch.full((4,), float(rank + 1)), torch.full((1, 2), float(rank + 1))]
        profiled(checker, f"all_reduce_coalesced {mode}", "commlib:all_reduce_coalesced", [[4], [1, 2]],
                 lambda ts=ts: dist.all_reduce_coalesced(ts, async_op=async_op))
        for tensor in ts:
            checker.equal(tensor.numpy(), np.full(tuple(tensor.shape), float(everyone)), f"all_reduce_coalesced {mode}")

        b = torch.full((5,), float(rank))
        profiled(checker, f"broadcast {mode}", "commlib:broadcast", [[5]],
                 lambda b=b: dist.broadcast(b, src=size - 1, async_op=async_op))
        checker.equal(b.numpy(), np.full(5, float(size - 1)), f"broadcast under the profiler {mode}")

        r = torch.full((3,), float(rank + 1))
        profiled(checker, f"reduce {mode}", "commlib:reduce", [[3]], lambda r=r: dist.reduce(r, 0, async_op=async_op))
        if rank == 0:
            checker.equal(r.numpy(), np.full(3, float(everyone)), f"reduce under the profiler {mode}")

        outs = [torch.zeros(2) for _ in range(size)]
        profiled(checker, f"all_gather {mode}", "commlib:all_gather", [[2]],
                 lambda outs=outs: dist.all_gather(outs, torch.full((2,), float(rank)), async_op=async_op))
        checker.equal(torch.stack(outs).numpy(), np.repeat(np.arange(size, dtype=np.float32)[:, None], 2, 1),
                      f"all_gather under the profiler {mode}")

        flat = torch.zeros(size * 2)
        profiled(checker, f"all_gather_into_tensor {mode}", "commlib:all_gather_into_tensor", [[2]],
                 lambda flat=flat: dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)), async_op=async_op))
        checker.equal(flat.numpy(), np.repeat(np.arange(size, dtype=np.float32), 2), f"all_gather_into_tensor {mode}")

        block = torch.zeros(2)
        profiled(checker, f"reduce_scatter_tensor {mode}", "commlib:reduce_scatter_tensor", [[2 * size]],
                 lambda block=block: dist.reduce_scatter_tensor(block, torch.arange(2.0 * size) + rank,
                                                                async_op=async_op))
        expected = size * np.arange(2.0 * rank, 2.0 * rank + 2) + sum(range(size))
        checker.equal(block.numpy(), expected.astype(np.float32), f"reduce_scatter_tensor under the profiler {mode}")

        swapped = torch.zeros(size)
        profiled(checker, f"all_to_all_single {mode}", "commlib:all_to_all", [[size]],
                 lambda swapped=swapped: dist.all_to_all_single(swapped, torch.arange(float(size)) + 10 * rank,
                                                                async_op=async_op))
        checker.equal(swapped.numpy(), (10 * np.arange(size) + rank).astype(np.float32), f"all_to_all_single {mode}")

        gathered = [torch.zeros(2) for _ in range(size)] if rank == 0 else None
        profiled(checker, f"gather {mode}", "commlib:gather", [[2]],
                 lambda gathered=gathered: dist.gather(torch.full((2,), float(rank)), gathered, 0, async_op=async_op))
        if rank == 0:
            checker.equal(torch.stack(gathered).numpy(), np.repeat(np.arange(size, dtype=np.float32)[:, None], 2, 1),
                          f"gather under the profiler {mode}")

        part = torch.zeros(2)
        parts = [torch.full((2,), 5.0 * r) for r in range(size)] if rank == 0 else None
        profiled(checker, f"scatter {mode}", "commlib:scatter", [[2]],
                 lambda part=part, parts=parts: dist.scatter(part, parts, 0, async_op=async_op))
        checker.equal(part.numpy(), np.full(2, 5.0 * rank, dtype=np.float32), f"scatter under the profiler {mode}")

        profiled(checker, f"barrier {mode}", "commlib:barrier", [], lambda: dist.barrier(async_op=async_op))


def check_all_gather_coalesced(checker, rank, size):
    inputs = [torch.full((2,), float(rank)), torch.full((1, 3), 10.0 * rank)]
    outputs = [[torch.zeros(2), torch.zeros(1, 3)] for _ in range(size)]
    profiled(checker, "all_gather_coalesced", "commlib:all_gather_coalesced", [[2], [1, 3]],
             lambda: dist.all_gather_coalesced(outputs, inputs))
    for sender, (first, second) in enumerate(outputs):
        checker.equal(first.numpy(), np.full(2, float(sender)), f"all_gather_coalesced input 0 from rank {sender}")
        checker.equal(second.numpy(), np.full((1, 3), 10.0 * sender),
                      f"all_gather_coalesced input 1 from rank {sender}")
    group = autograd_bridge.commlib_group_of()
    before = group.seq
    checker.raises(commlib.InvalidUsageError, lambda: dist.all_gather_coalesced(
        [[torch.zeros(2)] for _ in range(size)], inputs), "all_gather_coalesced with one output per rank too few",
        match="expected 2, one per input tensor")
    checker.raises(commlib.InvalidUsageError, lambda: dist.all_gather_coalesced(
        [[torch.zeros(3), torch.zeros(1, 3)] for _ in range(size)], inputs),
        "all_gather_coalesced with an output of the wrong shape", match="input 0")
    checker.check(group.seq == before, f"the refused all_gather_coalesced took {group.seq - before} collective numbers")


def check_point_to_point(checker, rank, size):
    right, left = (rank + 1) % size, (rank - 1) % size
    received = torch.zeros(3)
    with profiler.profile(record_shapes=True) as prof:
        sending = dist.isend(torch.full((3,), float(rank)), right)
        dist.recv(received, left)
        sending.wait()
        if rank == 0:
            senders = []
            for _ in range(size - 1):
                box = torch.zeros(2, 1)
                senders.append(dist.recv(box))
                checker.equal(box.numpy(), np.full((2, 1), 7.0 * senders[-1]), f"recv from any source ({senders[-1]})")
            checker.check(sorted(senders) == list(range(1, size)), f"recv from any source: senders {senders}")
        else:
            dist.send(torch.full((2, 1), 7.0 * rank), 0)
    checker.equal(received.numpy(), np.full(3, float(left)), "recv under the profiler")
    expected = {"commlib:send": (1 if rank == 0 else 2, [[[3]], [[2, 1]]]), "commlib:recv": (1, [[[3]]]),
                "commlib:recvAnySource": (size - 1 if rank == 0 else 0, [[[2, 1]]])}
    for title, (count, shapes) in expected.items():
        found = events_named(prof, title)
        checker.check(len(found) == count, f"point-to-point: {len(found)} {title} events, expected {count}")
        checker.check(all(e.is_async for e in found), f"point-to-point: a {title} event is not async")
        checker.check(all(e.input_shapes in shapes for e in found),
                      f"point-to-point: {title} shapes {[e.input_shapes for e in found]}, expected among {shapes}")


def check_ddp(checker, rank, size):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    data = torch.full((3, 4), float(rank + 1))
    model(data).sum().backward()  # the first backward rebuilds the buckets
    model.zero_grad()
    with profiler.profile(record_shapes=True) as prof:
        for _ in range(2):
            model(data).sum().backward()
    found = events_named(prof, "commlib:all_reduce")
    checker.check(len(found) == 2, f"DDP under the profiler: {len(found)} commlib:all_reduce events, expected 2")
    checker.check(all(e.is_async for e in found), "DDP under the profiler: an all_reduce event is not async")
    # d(sum of outputs)/d(bias) is the batch size per rank; averaged over ranks it stays 3.
    checker.equal(model.module.bias.grad.numpy(), np.full(2, 3.0 * 2), "DDP's bias gradient (two accumulated steps)")


def main():
    autograd_bridge.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    checker = Checker()
    check_collectives(checker, rank, size)
    check_all_gather_coalesced(checker, rank, size)
    if size > 1:
        check_point_to_point(checker, rank, size)
    check_ddp(checker, rank, size)
    t = torch.ones(3)
    dist.all_reduce(t)  # and without the profiler, the fast path again
    checker.equal(t.numpy(), np.full(3, float(size)), "all_reduce after profiling")
    dist.destroy_process_group()
    checker.finish()


if __name__ == "__main__":
    main()
