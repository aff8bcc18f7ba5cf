"""PYTHONPATH=. mpiexec -n P python tests/mpi/ddp_features_ranks.py

Comm hooks (default, fp16/bf16 compression, a user hook returning new memory), buffer broadcast
before forward, the one-time bucket rebuild in gradient-ready order, the tracer calls and the
step statistics.
"""

import numpy as np
import torch
import torch.nn.functional as F

import commlib
from commlib import ReduceOp
from ddp import DistributedDataParallel as DDP
from ddp.hooks import bf16_compress_hook, fp16_compress_hook
from tests.support.verdict import Checker

torch.set_num_threads(1)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 3))


def rank_batch(rank):
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(4, 10, generator=generator), torch.randn(4, 3, generator=generator)


def grads_after_one_step(group, hook=None, state=None, cap=0.001):
    model = DDP(mlp(), bucket_cap_mb=cap, first_bucket_cap_mb=cap)
    if hook is not None:
        model.register_comm_hook(state, hook)
    x, y = rank_batch(group.rank)
    F.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def expected_average_grads(size):
    model = mlp()
    for rank in range(size):
        x, y = rank_batch(rank)
        (F.mse_loss(model(x), y) / size).backward()
    return [p.grad for p in model.parameters()]


def check_comm_hooks(checker, group):
    expected = expected_average_grads(group.size)
    for name, hook, rtol in (("default", None, 1e-5), ("fp16", fp16_compress_hook, 2e-3),
                             ("bf16", bf16_compress_hook, 2e-2)):
        for got, want in zip(grads_after_one_step(group, hook), expected):
            checker.close(got, want, f"{name} hook grads", rtol=rtol, atol=rtol * 1e-1)

    calls = []

    def sum_into_copy(state, bucket):
        """A user hook: SUM (no average) into a new array, so the reducer has to copy it back."""
        state.append(bucket.index())
        copy = bucket.array().copy()
        return group.allreduce(copy, ReduceOp.SUM, async_op=True)

    def torch_future_hook(state, bucket):
        """torch's hook style: a torch.futures.Future whose value is [reduced tensor]."""
        future = torch.futures.Future()
        work = group.allreduce(bucket.array(), ReduceOp.AVG, async_op=True)
        work.add_done_callback(lambda w: future.set_result([bucket.buffer()]) if w.is_success()
                               else future.set_exception(w.exception()))
        return future

    for got, want in zip(grads_after_one_step(group, torch_future_hook), expected):
        checker.close(got, want, "torch-future hook grads", rtol=1e-5, atol=1e-6)
    for got, want in zip(grads_after_one_step(group, sum_into_copy, calls), expected):
        checker.close(got, want * group.size, "user SUM hook grads", rtol=1e-5, atol=1e-6)
    checker.check(calls == sorted(calls) and calls[0] == 0 and len(calls) >= 2,
                  f"user hook: buckets launched in order {calls}, expected 0, 1, 2, ...")


def check_broadcast_buffers(checker, group):
    for broadcast in (True, False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        model = DDP(net, broadcast_buffers=broadcast)
        net[1].running_mean.fill_(float(group.rank + 1))
        model.eval()
        with torch.no_grad():
            model(torch.randn(2, 4))
        expected = 1.0 if broadcast else float(group.rank + 1)
        checker.close(net[1].running_mean, np.full(4, expected), f"broadcast_buffers={broadcast}: running_mean")


class Reversed(torch.nn.Module):
    """Registered a, b, c but applied c, b, a: gradients become ready a first, unlike the initial plan."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.c = torch.nn.Linear(6, 6)

    def forward(self, x):
        return self.a(torch.tanh(self.b(torch.tanh(self.c(x)))))


class Recorder:
    def __init__(self):
        self.events = []

    def instant(self, name, lane, ts, args):
        self.events.append(("instant", name, lane, ts, ts, dict(args)))

    def span(self, name, lane, start, end, args):
        self.events.append(("span", name, lane, start, end, dict(args)))


def check_rebuild_and_tracing(checker, group):
    tracer = Recorder()
    model = DDP(Reversed(), bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6, tracer=tracer)
    initial = model.bucket_plan()
    checker.check(initial == [(5,), (4,), (3,), (2,), (1,), (0,)], f"initial plan {initial}: expected reverse order")
    x = torch.randn(3, 6)
    for step in range(3):
        model(x).sum().backward()
        plans = group.comm.allgather(model.bucket_plan())
        checker.check(all(p == plans[0] for p in plans), f"step {step}: ranks disagree on the plan {plans}")
    rebuilt = model.bucket_plan()
    # a (params 0, 1) becomes ready first, then b, then c: the rebuilt plan follows that
    checker.check([i for bucket in rebuilt for i in bucket][:2] in ([0, 1], [1, 0]),
                  f"rebuilt plan {rebuilt}: expected a's parameters (0, 1) first")

    instants = [e for e in tracer.events if e[1] == "bucket_ready"]
    spans = [e for e in tracer.events if e[1] == "allreduce"]
    finals = [e for e in tracer.events if e[1] == "finalize"]
    checker.check(len(instants) == 18 and len(spans) == 18 and len(finals) == 3,
                  f"tracer: {len(instants)} bucket_ready, {len(spans)} allreduce, {len(finals)} finalize; "
                  f"expected 18, 18, 3")
    checker.check(all(e[2] == "comm" and e[3] <= e[4] and set(e[5]) == {"bucket", "bytes", "algorithm"}
                      and e[5]["algorithm"] in commlib.algorithms() for e in spans),
                  f"tracer: malformed allreduce span {spans[:1]}")
    checker.check(all(e[2] == "compute" and set(e[5]) == {"bucket", "bytes", "params"} and e[5]["params"] == 1
                      for e in instants), "tracer: malformed bucket_ready instant")
    stats = model.last_step_stats()
    checker.check(stats["buckets"] == 6 and 0.0 <= stats["hidden_fraction"] <= 1.0
                  and stats["overlapped_comm_s"] <= stats["comm_s"] + 1e-9,
                  f"step stats {stats}")


def check_module_and_state_dict(checker, group):
    net = mlp()
    model = DDP(net)
    checker.check(model.module is net, "model.module is not the wrapped module")
    expected = ["module." + key for key in net.state_dict()]
    checker.check(list(model.state_dict()) == expected,
                  f"state_dict keys {list(model.state_dict())}, expected torch DDP's {expected}")
    model.load_state_dict(model.state_dict())


def check_algorithms(checker, group):
    expected = expected_average_grads(group.size)
    for algorithm in commlib.algorithms():
        model = DDP(mlp(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.001, algorithm=algorithm)
        x, y = rank_batch(group.rank)
        F.mse_loss(model(x), y).backward()
        for got, want in zip((p.grad for p in model.parameters()), expected):
            checker.close(got, want, f"algorithm={algorithm}: grads", rtol=1e-5, atol=1e-6)


class RankBranch(torch.nn.Module):
    """`branch` takes part on rank 0 only: locally unused elsewhere, globally used."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(10, 6)
        self.branch = torch.nn.Linear(6, 3)
        self.head = torch.nn.Linear(6, 3)
        self.never = torch.nn.Linear(6, 3)

    def forward(self, x, use_branch):
        h = torch.tanh(self.body(x))
        return self.head(h) + self.branch(h) if use_branch else self.head(h)


def check_data_dependent_unused(checker, group):
    for as_view in (False, True):
        model = DDP(RankBranch(), find_unused_parameters=True, gradient_as_bucket_view=as_view,
                    bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
        for _ in range(3):  # the buckets are rebuilt after step 0
            model.zero_grad()
            x, y = rank_batch(group.rank)
            F.mse_loss(model(x, group.rank == 0), y).backward()
        reference = RankBranch()
        for rank in range(group.size):
            x, y = rank_batch(rank)
            (F.mse_loss(reference(x, rank == 0), y) / group.size).backward()
        for (name, got), want in zip(model.module.named_parameters(), reference.parameters()):
            if want.grad is None:
                checker.check(got.grad is None, f"as_view={as_view}: {name} used by no rank has a grad")
            else:
                checker.close(got.grad, want.grad, f"as_view={as_view}: grad of {name} (used on rank 0 only)")


def check_buckets_in_shared_memory(checker, group):
    """On one host the buckets are symmetric buffers; with gradient_as_bucket_view the gradients
    autograd writes are those buffers, and averaging them needs no copy on the way."""
    expected = expected_average_grads(group.size)
    for as_view in (False, True):
        model = DDP(mlp(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.001, gradient_as_bucket_view=as_view)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        for step in range(3):  # the first backward rebuilds the buckets: check the rebuilt ones too
            optimizer.zero_grad(set_to_none=step == 1)
            x, y = rank_batch(group.rank)
            F.mse_loss(model(x), y).backward()
            for got, want in zip((p.grad for p in model.parameters()), expected):
                checker.close(got, want, f"as_view={as_view} step {step}: grads", rtol=1e-5, atol=1e-6)
        buckets = model.reducer.buckets
        shared = [group.host_memory.owns(bucket.array) for bucket in buckets]
        checker.check(all(shared) if group.prefers_symmetric_buffers else not any(shared),
                      f"as_view={as_view}: buckets in shared memory {shared}, one host "
                      f"{group.prefers_symmetric_buffers}")
        if as_view:
            spans = [(b.flat.data_ptr(), b.flat.data_ptr() + b.nbytes) for b in buckets]
            views = [any(lo <= p.grad.data_ptr() < hi for lo, hi in spans) for p in model.parameters()]
            checker.check(all(views), f"grads are views of the buckets: {views}")


def main():
    group = commlib.init()
    checker = Checker()
    check_comm_hooks(checker, group)
    check_broadcast_buffers(checker, group)
    check_rebuild_and_tracing(checker, group)
    check_algorithms(checker, group)
    check_data_dependent_unused(checker, group)
    check_module_and_state_dict(checker, group)
    check_buckets_in_shared_memory(checker, group)
    checker.finish()


if __name__ == "__main__":
    main()
