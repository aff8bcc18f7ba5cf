"""PYTHONPATH=. mpiexec -n 3 python tests/mpi/torch_collectives_ranks.py

The public torch.distributed collectives over the "commlib" backend, against closed forms.

Rank r contributes values derived from r, so every expected result is a formula. Each
collective runs sync and with async_op=True; allreduce over every dtype x op the backend
accepts, bitwise ops on integers, non-contiguous and empty tensors, subgroups, and the errors.
gather and scatter also against gloo in the same job, bit for bit, and each must be one commlib
gather / scatter (not a collective moving P times the bytes).
"""



import numpy as np
import torch
import torch.distributed as dist

import autograd_bridge
import commlib
from tests.support.gloo_compare import make, same_bits
from tests.support.verdict import Checker

torch.set_num_threads(1)
RED = dist.ReduceOp
N = 7
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
EXACT_OPS = {RED.SUM: np.sum, RED.MIN: np.min, RED.MAX: np.max, RED.PRODUCT: np.prod}


def contribution(rank, dtype, n=N):
    """Small integers (exact in every dtype, products < 127): k % 4 + 1 + rank."""
    return (torch.arange(n) % 4 + 1 + rank).to(dtype)


def as_f64(t):
    return t.to(torch.float64).numpy()


def run_async(async_op, fn):
    work = fn(async_op)
    if async_op:
        work.wait()


def check_allreduce(checker, rank, size):
    everyone = np.stack([as_f64(contribution(r, torch.float64)) for r in range(size)])
    for dtype in FLOATS + INTS:
        ops = dict(EXACT_OPS)
        if dtype.is_floating_point:
            ops[RED.AVG] = np.mean
        for op, reduce in ops.items():
            for async_op in (False, True):
                t = contribution(rank, dtype)
                run_async(async_op, lambda a: dist.all_reduce(t, op=op, async_op=a))
                what = f"all_reduce {dtype} {op} async_op={async_op}"
                expected = reduce(everyone, axis=0)
                if op == RED.AVG and dtype in (torch.float16, torch.bfloat16):
                    checker.close(as_f64(t), expected, what, rtol=1e-2, atol=0)
                elif op == RED.AVG:
                    checker.close(as_f64(t), expected, what, rtol=1e-6, atol=0)
                else:
                    checker.equal(as_f64(t), expected, what)
    bits = [(1 << r) | 64 for r in range(size)]
    for dtype in (torch.uint8, torch.int32, torch.int64):
        for op, fn in ((RED.BAND, np.bitwise_and), (RED.BOR, np.bitwise_or), (RED.BXOR, np.bitwise_xor)):
            t = torch.full((5,), bits[rank], dtype=dtype)
            dist.all_reduce(t, op=op)
            checker.equal(t.numpy(), np.full(5, fn.reduce(bits)), f"all_reduce {dtype} {op}")
    flags = torch.tensor([rank == 0, True, rank == size - 1, False])
    dist.all_reduce(flags, op=RED.BOR)
    checker.equal(flags.numpy(), np.array([True, True, True, False]), "all_reduce bool BOR")
    # A work's future carries the tensors (DDP's hooks read fut.value()[0]).
    t = contribution(rank, torch.float32)
    work = dist.all_reduce(t, async_op=True)
    value = work.get_future().wait()
    checker.check(value[0] is t or value[0].data_ptr() == t.data_ptr(), "future value is not the tensor")
    checker.equal(as_f64(t), everyone.sum(axis=0), "all_reduce future value")
    # Many in flight at once, waited in reverse: issue order is completion order.
    tensors = [torch.full((1000 * (i + 1),), float(rank + i)) for i in range(8)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    for work in reversed(works):
        work.wait()
    for i, t in enumerate(tensors):
        checker.equal(t.numpy(), np.full(t.numel(), float(sum(r + i for r in range(size)))), f"in flight #{i}")
    big = torch.full((1 << 20,), float(rank))  # 4 MiB: past every inline threshold
    dist.all_reduce(big)
    checker.equal(big[::4099].numpy(), np.full(big[::4099].numel(), float(sum(range(size)))), "all_reduce 4 MiB")
    # Non-contiguous: staged through a copy and written back.
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4) + rank
    view = base.t()
    dist.all_reduce(view)
    checker.equal(base.numpy(), (np.arange(12).reshape(3, 4) * size + sum(range(size))), "all_reduce transposed")
    # The sync path caches the numpy view of the last tensor: swapping its storage or its
    # dtype under the same Python object must not reuse a stale view.
    reused = torch.ones(4)
    dist.all_reduce(reused)
    reused.set_(torch.full((6,), 2.0))
    dist.all_reduce(reused)
    checker.equal(reused.numpy(), np.full(6, 2.0 * size), "all_reduce after set_ to new storage")
    reused.data = torch.full((6,), 3, dtype=torch.int32)
    dist.all_reduce(reused)
    checker.equal(reused.numpy(), np.full(6, 3 * size), "all_reduce after a dtype change")
    empty = torch.empty(0)
    dist.all_reduce(empty)
    checker.check(empty.numel() == 0, "all_reduce of an empty tensor")
    requires = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        dist.all_reduce(requires)
    checker.equal(requires.detach().numpy(), np.full(3, float(size)), "all_reduce of a leaf that requires grad")


def check_others(checker, rank, size):
    for root in range(size):
        for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.bool):
            for async_op in (False, True):
                t = contribution(rank, dtype) if dtype != torch.bool else torch.tensor([rank % 2 == 0] * 3)
                expected = contribution(root, dtype) if dtype != torch.bool else torch.tensor([root % 2 == 0] * 3)
                run_async(async_op, lambda a: dist.broadcast(t, root, async_op=a))
                checker.equal(as_f64(t), as_f64(expected), f"broadcast {dtype} root {root} async_op={async_op}")
        t = contribution(rank, torch.int32)
        dist.reduce(t, root, op=RED.SUM)
        if rank == root:
            checker.equal(t.numpy(), sum(contribution(r, torch.int32) for r in range(size)).numpy(),
                          f"reduce to {root}")
    for async_op in (False, True):
        outs = [torch.full((2, 3), -1, dtype=torch.int64) for _ in range(size)]
        mine = torch.full((2, 3), 10 * rank + 1, dtype=torch.int64)
        run_async(async_op, lambda a: dist.all_gather(outs, mine, async_op=a))
        for r, out in enumerate(outs):
            checker.equal(out.numpy(), np.full((2, 3), 10 * r + 1), f"all_gather [{r}] async_op={async_op}")
        flat = torch.zeros(size * 4, dtype=torch.float16)
        mine = torch.full((4,), rank + 0.5, dtype=torch.float16)
        run_async(async_op, lambda a: dist.all_gather_into_tensor(flat, mine, async_op=a))
        checker.equal(as_f64(flat), np.repeat(np.arange(size) + 0.5, 4), f"all_gather_into_tensor async_op={async_op}")
        for op, combine in ((RED.SUM, np.sum), (RED.MAX, np.max), (RED.AVG, np.mean)):
            inp = torch.arange(size * 3, dtype=torch.float64) * (rank + 1)
            out = torch.zeros(3, dtype=torch.float64)
            run_async(async_op, lambda a: dist.reduce_scatter_tensor(out, inp, op=op, async_op=a))
            full = combine(np.stack([np.arange(size * 3) * (r + 1.0) for r in range(size)]), axis=0)
            checker.close(out.numpy(), full[rank * 3:(rank + 1) * 3], f"reduce_scatter_tensor {op} async_op={async_op}")
        parts = [torch.full((2,), float(rank * 100 + i)) for i in range(size)]
        out = torch.zeros(2)
        run_async(async_op, lambda a: dist.reduce_scatter(out, parts, async_op=a))
        checker.equal(out.numpy(), np.full(2, float(sum(r * 100 + rank for r in range(size)))),
                      f"reduce_scatter list async_op={async_op}")
        run_async(async_op, lambda a: dist.barrier(async_op=a))
    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank, "text": "x" * rank})
    checker.check(objects == [{"rank": r, "text": "x" * r} for r in range(size)], f"all_gather_object gave {objects}")
    box = [{"from": rank}]
    dist.broadcast_object_list(box, src=size - 1)
    checker.check(box == [{"from": size - 1}], f"broadcast_object_list gave {box}")
    checker.check(True, "barrier returned")


# gather / scatter against gloo: every dtype the backend takes (gloo has no complex: those only
# against the senders' tensors), an odd size, a transposed (non-contiguous) 5x3 view, empty.
GATHER_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                 torch.int8, torch.uint8, torch.bool, torch.complex64)
LAYOUTS = {"odd 7": ((7,), False), "transposed 5x3": ((3, 5), True), "empty": ((0,), False)}


def laid_out(layout, dtype, seed):
    shape, transposed = LAYOUTS[layout]
    tensor = make(shape, dtype, seed)
    return tensor.t() if transposed else tensor


def blank(layout, dtype):
    shape, transposed = LAYOUTS[layout]
    tensor = torch.zeros(shape, dtype=dtype)
    return tensor.t() if transposed else tensor


def check_gather_scatter(checker, gloo, rank, size):
    """dist.gather / dist.scatter, sync and async, to and from every root: gloo's bits, the senders'
    tensors, gloo's future values; and each call is one commlib gather / scatter (the progress
    board holds the collective a call started: the old route was an allgather / a broadcast)."""
    ours = autograd_bridge.commlib_group_of()

    def run(group, collective, async_op, call):
        before = ours.seq
        work = call()
        value = None
        if async_op:
            work.wait()
            value = work.get_future().value()
        if group is None:  # the route: one collective number, and it was `collective`
            checker.check(ours.seq == before + 1, f"{collective}: {ours.seq - before} commlib collectives, expected 1")
            if ours.progress is not None:  # None at P=1 (no peer ever reads it)
                checker.check(ours.progress.last_started() == (before + 1, collective),
                              lambda: f"{collective}: commlib started {ours.progress.last_started()}, "
                                      f"expected ({before + 1}, {collective!r})")
        return value

    def gather(group, root, dtype, layout, async_op):
        outs = [blank(layout, dtype) for _ in range(size)] if rank == root else None
        inp = laid_out(layout, dtype, 1000 * root + rank)
        value = run(group, "gather", async_op,
                    lambda: dist.gather(inp, outs, dst=root, group=group, async_op=async_op))
        return outs or [], value

    def scatter(group, root, dtype, layout, async_op):
        out = blank(layout, dtype)
        parts = [laid_out(layout, dtype, 5000 + 1000 * root + r) for r in range(size)] if rank == root else None
        value = run(group, "scatter", async_op,
                    lambda: dist.scatter(out, parts, src=root, group=group, async_op=async_op))
        return out, value

    cases = [(root, dtype, layout, async_op) for root in range(size) for dtype in GATHER_DTYPES
             for layout in LAYOUTS for async_op in (False, True)]
    for case in cases:
        root, dtype, layout, async_op = case
        what = f"{dtype} {layout} root {root} async_op={async_op}"
        with_gloo = not dtype.is_complex
        gathered, value = gather(None, *case)
        theirs, their_value = gather(gloo, *case) if with_gloo else (None, None)
        checker.check(len(gathered) == (size if rank == root else 0), f"gather {what}: {len(gathered)} outputs")
        for sender, got in enumerate(gathered):
            same_bits(checker, got, laid_out(layout, dtype, 1000 * root + sender),
                      f"gather {what}: rank {sender}'s tensor")
            if with_gloo:
                same_bits(checker, got, theirs[sender], f"gather {what}: from rank {sender}")
        if async_op:  # like gloo's: the gather list on the root, nothing elsewhere
            checker.check(len(value) == len(gathered) and all(v.data_ptr() == g.data_ptr()
                                                              for v, g in zip(value, gathered)),
                          f"gather {what}: future value {value!r} is not the gather list")
            if with_gloo:
                checker.check(len(value) == len(their_value),
                              f"gather {what}: future value of {len(value)}, gloo's of {len(their_value)}")
        out, value = scatter(None, *case)
        their_out, their_value = scatter(gloo, *case) if with_gloo else (None, None)
        same_bits(checker, out, laid_out(layout, dtype, 5000 + 1000 * root + rank), f"scatter {what}: vs the root's")
        if with_gloo:
            same_bits(checker, out, their_out, f"scatter {what}")
        if async_op:
            # (torch views a complex tensor as real before it reaches a backend: compare memory)
            checker.check(len(value) == 1 and value[0].data_ptr() == out.data_ptr(),
                          f"scatter {what}: future value {value!r}")
            if with_gloo:
                checker.check(len(their_value) == 1, f"scatter {what}: gloo's future value {their_value!r}")
    # Bad lists raise on the root before anything is sent (so only the root calls; no number taken).
    pg = dist.distributed_c10d._get_default_group()
    gather_opts, scatter_opts = dist.GatherOptions(), dist.ScatterOptions()
    gather_opts.rootRank = scatter_opts.rootRank = rank
    before = ours.seq
    checker.raises(commlib.InvalidUsageError, lambda: pg.gather([[torch.zeros(2)] * (size + 1)], [torch.zeros(2)],
                                                                gather_opts),
                   "gather with a list of world size + 1", match=f"has {size + 1} tensors; expected world size {size}")
    checker.raises(commlib.InvalidUsageError, lambda: pg.scatter([torch.zeros(2)], [[torch.zeros(3)] * size],
                                                                 scatter_opts),
                   "scatter with parts of another shape", match="scatter_list[0] is torch.float32 (3,); expected")
    checker.check(ours.seq == before, f"the refused gather/scatter took {ours.seq - before} collective numbers")
    objects = [None] * size if rank == size - 1 else None
    dist.gather_object({"rank": rank, "text": "y" * (3 * rank)}, objects, dst=size - 1)
    if rank == size - 1:
        checker.check(objects == [{"rank": r, "text": "y" * (3 * r)} for r in range(size)],
                      f"gather_object gave {objects}")
    received = [None]
    dist.scatter_object_list(received, [{"to": r, "pad": "z" * r} for r in range(size)] if rank == 0 else None, src=0)
    checker.check(received == [{"to": rank, "pad": "z" * rank}], f"scatter_object_list gave {received}")


def check_subgroup_and_errors(checker, rank, size):
    members = [0, size - 1] if size > 1 else [0]
    sub = dist.new_group(ranks=members, backend="commlib")
    if rank in members:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub)
        checker.equal(t.numpy(), np.array([float(sum(set(members)))]), f"subgroup {members} all_reduce")
        checker.check(isinstance(sub, autograd_bridge.CommlibProcessGroup), f"subgroup is {sub!r}")
    checker.raises(commlib.InvalidUsageError, lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=RED.AVG),
                   "AVG of int32", match="AVG")
    checker.raises(commlib.InvalidUsageError, lambda: dist.all_reduce(torch.ones(2), op=RED.BAND),
                   "BAND of float32", match="integer")
    checker.raises(commlib.InvalidUsageError, lambda: dist.all_gather([torch.zeros(3)] * size, torch.zeros(2)),
                   "all_gather with wrong output shapes", match="expected")
    # Nothing was sent by the failed calls: the group still works.
    t = torch.ones(1)
    dist.all_reduce(t)
    checker.equal(t.numpy(), np.array([float(size)]), "all_reduce after usage errors")


def check_async_failure(checker, rank, size):
    """An error on the communication thread reaches the caller through the torch Work."""
    from datetime import timedelta

    from mpi4py import MPI

    sub = dist.new_group(backend="commlib", timeout=timedelta(seconds=1))
    t = torch.ones(4)
    if rank == 0:  # alone: the others join only after rank 0 gave up
        work = dist.all_reduce(t, group=sub, async_op=True)
        error = checker.raises(Exception, work.wait, "wait on an allreduce no peer joined", match="timed out")
        checker.check(error is None or "allreduce" in str(error), f"error does not name the collective: {error}")
        checker.raises(Exception, lambda: dist.all_reduce(t, group=sub), "the group after a failure",
                       match="earlier")
    MPI.COMM_WORLD.Barrier()
    if rank != 0:  # match rank 0's abandoned MPI request, so no collective is left pending
        dist.all_reduce(t, group=sub)
    MPI.COMM_WORLD.Barrier()


def main():
    from mpi4py import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    checker = Checker()
    # torch's rank/world_size must be MPI's: a clear error before anything else happens.
    checker.raises(commlib.InvalidUsageError,
                   lambda: dist.init_process_group("commlib", rank=(rank + 1) % (size + 1), world_size=size + 1,
                                                   store=dist.HashStore()),
                   "init_process_group with ranks that are not MPI's", match="mpiexec")
    checker.check(not dist.is_initialized(), "a failed init_process_group left torch initialized")
    pg = autograd_bridge.init_process_group()
    checker.check(dist.get_backend() == "commlib", f"backend is {dist.get_backend()!r}")
    checker.check(isinstance(pg, autograd_bridge.CommlibProcessGroup), f"default group is {pg!r}")
    checker.check((dist.get_rank(), dist.get_world_size()) == (rank, size), "rank/world size differ from MPI's")
    check_allreduce(checker, rank, size)
    check_others(checker, rank, size)
    check_gather_scatter(checker, dist.new_group(backend="gloo"), rank, size)
    check_subgroup_and_errors(checker, rank, size)
    if size > 1:
        check_async_failure(checker, rank, size)
    dist.destroy_process_group()
    checker.finish()


if __name__ == "__main__":
    main()
