"""PYTHONPATH=. mpiexec -n 3 python tests/mpi/torch_exchange_ranks.py

The "commlib" torch backend's point-to-point and all-to-all, against gloo in the same job.

Every operation runs on the default "commlib" group and on a gloo group of the same ranks with
the same inputs, sync and async, and the results must be equal to the bit: send/recv (named
source too), recv from any source, isend/irecv, batch_isend_irecv, all_to_all with uneven
tensors, all_to_all_single with and without split sizes. Then the monitored barrier; a
two-stage pipeline-parallel training step (rank 0 sends activations to rank 1, gradients come
back) against the same model trained in one process; and a mixture-of-experts layer's token
exchange (all_to_all_single with split sizes, forward and backward through
``functional.all_to_all``) against a single-process computation of the same batches.
"""

from datetime import timedelta


import torch
import torch.distributed as dist

import autograd_bridge
import commlib
from autograd_bridge import functional as F
from tests.support.gloo_compare import make, on_both, same_bits
from tests.support.verdict import Checker

torch.set_num_threads(1)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int8, torch.uint8,
          torch.bool, torch.complex64)


def check_send_recv(checker, gloo, rank, size):
    right, left = (rank + 1) % size, (rank - 1) % size
    for dtype in DTYPES:
        for count in (0, 1, 7, 1000):
            for async_op in (False, True):
                def ring(group):
                    out = make((count,), dtype, 10 * rank + count)
                    got = torch.zeros(count, dtype=dtype)
                    if async_op:
                        works = [dist.irecv(got, left, group=group, tag=5), dist.isend(out, right, group=group, tag=5)]
                        for work in works:
                            work.wait()
                        return got, left
                    if rank % 2 == 0:
                        dist.send(out, right, group=group, tag=5)
                        source = dist.recv(got, left, group=group, tag=5)
                    else:
                        source = dist.recv(got, left, group=group, tag=5)
                        dist.send(out, right, group=group, tag=5)
                    return got, source

                (ours, our_source), (theirs, their_source) = on_both(gloo, ring)
                what = f"send/recv {dtype} n={count} async={async_op}"
                same_bits(checker, ours, theirs, what)
                same_bits(checker, ours, make((count,), dtype, 10 * left + count), f"{what} vs the sender's tensor")
                checker.check(our_source == their_source == left, f"{what}: source {our_source} / gloo {their_source}")
    # Non-contiguous receive buffers are written back.
    base = torch.zeros(4, 3)
    if rank % 2 == 0:
        dist.send(torch.arange(12.0).reshape(3, 4) + rank, right)
        dist.recv(base.t(), left)
    else:
        dist.recv(base.t(), left)
        dist.send(torch.arange(12.0).reshape(3, 4) + rank, right)
    checker.equal(base.t().numpy(), (torch.arange(12.0).reshape(3, 4) + left).numpy(), "recv into a transposed view")


def check_recv_anysource(checker, gloo, rank, size):
    def gather_any(group):
        if rank != 0:
            dist.send(torch.full((3,), float(rank)), 0, group=group, tag=9)
            return {}
        seen = {}
        for _ in range(size - 1):
            buf = torch.empty(3)
            source = dist.recv(buf, group=group, tag=9)
            seen[source] = buf
        return seen

    ours, theirs = on_both(gloo, gather_any)
    checker.check(sorted(ours) == sorted(theirs) == (list(range(1, size)) if rank == 0 else []),
                  f"recv from any source: commlib saw {sorted(ours)}, gloo {sorted(theirs)}")
    for source, buf in ours.items():
        same_bits(checker, buf, theirs[source], f"recv from any source: rank {source}'s message")
    # Its own tag: a wildcard receive would also match the next check's tag-0 messages.
    if rank == 0:
        work = dist.irecv(torch.empty(2), tag=13)
    if rank == size - 1:
        dist.send(torch.ones(2), 0, tag=13)
    if rank == 0:
        work.wait()
        checker.check(work._source_rank() == size - 1, f"irecv(src=None) source {work._source_rank()}")


def check_batch_isend_irecv(checker, gloo, rank, size):
    for dtype in (torch.float32, torch.int64, torch.bool):
        def batch(group):
            got = [torch.zeros(5, dtype=dtype), torch.zeros(2, 3, dtype=dtype)]
            ops = [dist.P2POp(dist.irecv, got[0], (rank - 1) % size, group),  # receives first: no deadlock
                   dist.P2POp(dist.irecv, got[1], (rank + 1) % size, group),
                   dist.P2POp(dist.isend, make((5,), dtype, rank), (rank + 1) % size, group),
                   dist.P2POp(dist.isend, make((2, 3), dtype, 100 + rank), (rank - 1) % size, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            return got

        ours, theirs = on_both(gloo, batch)
        for index in range(2):
            same_bits(checker, ours[index], theirs[index], f"batch_isend_irecv {dtype} #{index}")
        same_bits(checker, ours[1], make((2, 3), dtype, 100 + (rank + 1) % size), f"batch_isend_irecv {dtype} content")


def check_all_to_all(checker, gloo, rank, size):
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8):
        for async_op in (False, True):
            def listed(group, uneven):  # uneven: rank r sends (r + j + 1) elements to j (gloo: equal only)
                inputs = [make((rank + j + 1 if uneven else 4,), dtype, 1000 * rank + j) for j in range(size)]
                outputs = [torch.zeros(i + rank + 1 if uneven else 4, dtype=dtype) for i in range(size)]
                work = dist.all_to_all(outputs, inputs, group=group, async_op=async_op)
                if async_op:
                    work.wait()
                return outputs

            ours, theirs = on_both(gloo, lambda group: listed(group, False))
            for i in range(size):
                same_bits(checker, ours[i], theirs[i], f"all_to_all {dtype} from {i} async={async_op}")
            ours = listed(None, True)
            for i in range(size):
                same_bits(checker, ours[i], make((i + rank + 1,), dtype, 1000 * i + rank),
                          f"all_to_all uneven {dtype} from {i} async={async_op}")

            def single(group, splits):
                rows_in = [rank + j + 1 for j in range(size)] if splits else [2] * size
                rows_out = [i + rank + 1 for i in range(size)] if splits else [2] * size
                inp = make((sum(rows_in), 3), dtype, 77 + rank)
                out = torch.zeros(sum(rows_out), 3, dtype=dtype)
                work = dist.all_to_all_single(out, inp, rows_out if splits else None, rows_in if splits else None,
                                              group=group, async_op=async_op)
                if async_op:
                    work.wait()
                return out

            for splits in (False, True):
                ours, theirs = on_both(gloo, lambda group: single(group, splits))
                same_bits(checker, ours, theirs, f"all_to_all_single {dtype} splits={splits} async={async_op}")
    checker.raises(commlib.InvalidUsageError,
                   lambda: dist.all_to_all_single(torch.zeros(size), torch.zeros(size), [1] * size, [2] * size),
                   "all_to_all_single with splits that do not add up", match="add up")


def check_monitored_barrier(checker, gloo, rank, size):
    ours = dist.distributed_c10d._get_default_group()
    ours.monitored_barrier(timedelta(seconds=30))
    dist.monitored_barrier(group=gloo, timeout=timedelta(seconds=30))
    checker.check(True, "monitored barrier with every rank, commlib and gloo")
    late = size - 1
    if rank != late:
        checker.raises(commlib.CommTimeoutError, lambda: ours.monitored_barrier(timedelta(seconds=0.5), True),
                       "monitored barrier with a late rank", match=f"rank(s) {late} did not arrive")
    dist.barrier(group=gloo)
    if rank == late:
        checker.raises(commlib.CommTimeoutError, lambda: ours.monitored_barrier(timedelta(seconds=0.5)),
                       "the late rank", match="rank 0")
    dist.barrier(group=gloo)


# -- pipeline parallelism: two stages on ranks 0 and 1 -----------------------------------------
def pipeline_model():
    torch.manual_seed(3)
    stage0 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.ReLU())
    stage1 = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 4))
    return stage0, stage1


def pipeline_batches(steps, microbatches):
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(microbatches)]
            for _ in range(steps)]


def check_pipeline_training(checker, rank, steps=3, microbatches=2):
    """GPipe: all microbatches forward (activations 0 -> 1), then backward (gradients 1 -> 0)."""
    batches = pipeline_batches(steps, microbatches)
    reference = torch.nn.Sequential(*pipeline_model())  # the same model, trained in this process
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for step in batches:
        optimizer.zero_grad()
        for x, y in step:
            (torch.nn.functional.mse_loss(reference(x), y) / microbatches).backward()
        optimizer.step()
    if rank > 1:
        return
    stage = pipeline_model()[rank]
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    for number, step in enumerate(batches):
        optimizer.zero_grad()
        if rank == 0:
            outputs = [stage(x) for x, _ in step]
            sends = [dist.isend(out.detach(), 1, tag=100 + k) for k, out in enumerate(outputs)]
            for k, out in enumerate(outputs):  # backward as each microbatch's gradient arrives
                grad = torch.empty_like(out)
                dist.recv(grad, 1, tag=200 + k)
                out.backward(grad)
            for work in sends:
                work.wait()
        else:
            inputs = [torch.empty(5, 16) for _ in step]
            works = [dist.irecv(buf, 0, tag=100 + k) for k, buf in enumerate(inputs)]
            for k, ((_, y), work) in enumerate(zip(step, works)):
                work.wait()
                activation = inputs[k].requires_grad_()
                (torch.nn.functional.mse_loss(stage(activation), y) / microbatches).backward()
                if number % 2:
                    dist.send(activation.grad, 0, tag=200 + k)
                else:
                    dist.isend(activation.grad, 0, tag=200 + k).wait()
        optimizer.step()
    mine, theirs = list(stage.parameters()), list(reference[rank].parameters())
    checker.check(len(mine) == len(theirs), "pipeline stage parameter count")
    for index, (a, b) in enumerate(zip(mine, theirs)):
        checker.equal(a.detach().numpy(), b.detach().numpy(),
                      f"pipeline stage {rank} parameter {index} after {steps} steps")


# -- a mixture-of-experts layer: tokens to the rank that holds their expert, and back ----------
def moe_tokens(rank, count=13, dim=6):
    g = torch.Generator().manual_seed(500 + rank)
    return torch.randn(count, dim, generator=g), torch.randint(0, 10 ** 6, (count,), generator=g)


def expert(e, dim=6):
    torch.manual_seed(900 + e)
    return torch.nn.Linear(dim, dim)


def moe_layer(tokens, routes, size, my_expert, exchange):
    """Route each token to expert routes % size, run the experts, bring the results back."""
    experts = routes % size
    order = torch.argsort(experts, stable=True)
    send_counts = torch.bincount(experts, minlength=size)
    recv_counts = exchange(send_counts.clone(), None, None)  # how many tokens each rank sends me
    received = exchange(tokens[order], recv_counts.tolist(), send_counts.tolist())
    processed = my_expert(received)
    returned = exchange(processed, send_counts.tolist(), recv_counts.tolist())
    out = torch.empty_like(returned)
    out[order] = returned
    return out


def check_moe(checker, gloo, rank, size):
    tokens, routes = moe_tokens(rank)
    tokens.requires_grad_()
    mine = expert(rank)

    def exchange_on(group):
        def exchange(x, out_splits, in_splits):
            out = torch.empty((sum(out_splits) if out_splits else x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype)
            dist.all_to_all_single(out, x.detach().contiguous(), out_splits, in_splits, group=group)
            return out
        return exchange

    def differentiable(x, out_splits, in_splits):
        if out_splits is None:
            return exchange_on(None)(x, None, None)
        return F.all_to_all(x, out_splits, in_splits)

    with torch.no_grad():
        via_commlib = moe_layer(tokens, routes, size, mine, exchange_on(None))
        via_gloo = moe_layer(tokens, routes, size, mine, exchange_on(gloo))
    same_bits(checker, via_commlib, via_gloo, "MoE forward, commlib vs gloo")
    out = moe_layer(tokens, routes, size, mine, differentiable)
    same_bits(checker, out.detach(), via_commlib, "MoE forward through functional.all_to_all")
    out.pow(2).sum().backward()

    # One process: every rank's tokens, each expert run on the same batch (senders in rank order).
    everyone = [moe_tokens(r) for r in range(size)]
    leaves = [t.clone().requires_grad_() for t, _ in everyone]
    experts = [expert(e) for e in range(size)]
    batches = {e: [] for e in range(size)}
    for r, (_, routes_r) in enumerate(everyone):
        order = torch.argsort(routes_r % size, stable=True)
        for index in order.tolist():
            batches[int(routes_r[index]) % size].append((r, index))
    results = {}
    for e, members in batches.items():
        if members:
            outputs = experts[e](torch.stack([leaves[r][i] for r, i in members]))
            for (r, i), row in zip(members, outputs):
                results[(r, i)] = row
    reference = torch.stack([results[(rank, i)] for i in range(tokens.shape[0])])
    same_bits(checker, via_commlib, reference.detach(), "MoE forward vs one process")
    total = sum(results[key].pow(2).sum() for key in sorted(results))
    total.backward()
    checker.close(tokens.grad.numpy(), leaves[rank].grad.numpy(), "MoE token gradients vs one process",
                  rtol=1e-5, atol=1e-6)
    checker.close(mine.weight.grad.numpy(), experts[rank].weight.grad.numpy(),
                  "MoE expert weight gradient vs one process", rtol=1e-5, atol=1e-6)


def main():
    autograd_bridge.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    checker = Checker()
    commlib_group = autograd_bridge.commlib_group_of()
    # The backend's anchor (an async barrier issued when the group was made) takes its number
    # when it starts, which on a loaded machine can be after this point: let it run first.
    dist.barrier()
    seq = commlib_group.seq
    check_send_recv(checker, gloo, rank, size)
    check_recv_anysource(checker, gloo, rank, size)
    check_batch_isend_irecv(checker, gloo, rank, size)
    checker.check(commlib_group.seq == seq, f"point-to-point took {commlib_group.seq - seq} collective numbers")
    check_all_to_all(checker, gloo, rank, size)
    check_monitored_barrier(checker, gloo, rank, size)
    check_pipeline_training(checker, rank)
    check_moe(checker, gloo, rank, size)
    dist.destroy_process_group()
    checker.finish()


if __name__ == "__main__":
    main()
