"""PYTHONPATH=. mpiexec -n P python tests/mpi/ddp_errors_ranks.py

Every error path of DDP gives a clear error (never a hang) that names what went wrong, on every
rank, and the defined edge behaviours (forward twice, backward without forward) hold.
"""

import torch

import commlib
from commlib import GroupAbortedError, register_algorithm
from ddp import DistributedDataParallel as DDP
from tests.support.verdict import Checker

torch.set_num_threads(1)


def mlp(hidden=8, extra=False):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)]
    if extra:
        layers.append(torch.nn.Linear(2, 2))
    return torch.nn.Sequential(*layers)


class WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used = torch.nn.Linear(4, 2)
        self.never = torch.nn.Linear(4, 2)

    def forward(self, x, use_never=False):
        out = self.used(x)
        return out + self.never(x) if use_never else out


def check_mismatched_models(checker, group):
    last = group.size - 1
    if group.size < 2:
        return
    checker.raises(RuntimeError, lambda: DDP(mlp(extra=group.rank == last)), "different parameter counts",
                   match=f"rank {last} has")
    error = checker.raises(RuntimeError, lambda: DDP(mlp(hidden=9 if group.rank == last else 8)),
                           "different shapes", match=f"on rank {last}")
    checker.check(error is not None and "'0.weight'" in str(error),
                  f"shape mismatch message should name parameter '0.weight': {error}")
    # the group is still usable after the failed checks
    model = DDP(mlp())
    model(torch.ones(1, 4)).sum().backward()


def check_bad_arguments(checker, group):
    checker.raises(ValueError, lambda: DDP(mlp(), bucket_cap_mb=0), "bucket_cap_mb=0", match="bucket_cap_mb")
    checker.raises(ValueError, lambda: DDP(mlp(), first_bucket_cap_mb=-1), "first_bucket_cap_mb<0",
                   match="first_bucket_cap_mb")
    checker.raises(TypeError, lambda: DDP(lambda x: x), "not a module", match="torch.nn.Module")


def check_unused_without_find_unused(checker, group):
    model = DDP(WithUnused(), bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)
    x = torch.ones(2, 4) * (group.rank + 1)
    error = checker.raises(RuntimeError, lambda: model(x).sum().backward(), "unused parameter",
                           match="never.weight")
    checker.check(error is not None and "find_unused_parameters=True" in str(error),
                  f"unused-parameter error should suggest find_unused_parameters=True: {error}")
    # the next (complete) iteration works and averages
    model.zero_grad()
    model(x, use_never=True).sum().backward()
    mean_x = sum(r + 1 for r in range(group.size)) / group.size
    checker.close(model.module.never.weight.grad, torch.full((2, 4), 2 * mean_x), "grads after the error")


def check_backward_without_forward(checker, group):
    model = DDP(mlp())
    checker.raises(RuntimeError, lambda: model.module(torch.ones(1, 4)).sum().backward(),
                   "backward through model.module", match="no DDP forward prepared")
    out = model(torch.ones(1, 4)).sum()
    out.backward(retain_graph=True)
    checker.raises(RuntimeError, lambda: out.backward(), "second backward through one forward",
                   match="no DDP forward prepared")
    # no_sync: nothing to reduce, so a backward after a no_sync forward is fine
    with model.no_sync():
        model(torch.ones(1, 4)).sum().backward()


def check_forward_twice(checker, group):
    model = DDP(mlp())
    x = torch.full((1, 4), float(group.rank + 1))
    model(x)                                  # output dropped, no backward
    model(x).sum().backward()
    reference = mlp()
    for rank in range(group.size):
        (reference(torch.full((1, 4), float(rank + 1))).sum() / group.size).backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        checker.close(got.grad, want.grad, "forward twice then backward: grads")


def check_comm_failure_surfaces(checker, group):
    if group.size < 2:
        return  # a one-rank group never runs the algorithm

    def failing_allreduce(transport, buf, op, *, segment_bytes):
        raise RuntimeError(f"injected failure on rank {transport.rank}")

    register_algorithm("ddp_test_failing", failing_allreduce, replace=True)
    sub = group.new_group(list(range(group.size)))  # poisoning it must not poison the world group
    model = DDP(mlp(), process_group=sub, algorithm="ddp_test_failing")
    checker.raises(RuntimeError, lambda: model(torch.ones(1, 4)).sum().backward(),
                   "collective failing on the comm thread", match="injected failure")
    checker.raises(GroupAbortedError, lambda: model(torch.ones(1, 4)).sum().backward(),
                   "the next iteration on the poisoned group", match="injected failure")


def check_hook_failure_then_forward(checker, group):
    model = DDP(mlp(), bucket_cap_mb=1e-6, first_bucket_cap_mb=1e-6)

    def hook(state, bucket):
        if bucket.index() == 1:
            raise ValueError("hook refuses bucket 1")
        return bucket.process_group.allreduce(bucket.array(), async_op=True)

    model.register_comm_hook(None, hook)
    checker.raises(ValueError, lambda: model(torch.ones(1, 4)).sum().backward(), "comm hook raising",
                   match="hook refuses bucket 1")
    model.register_comm_hook(None, lambda state, bucket: bucket.process_group.allreduce(
        bucket.array(), commlib.ReduceOp.AVG, async_op=True))
    # either backward's end or the next forward reports it; afterwards the model works again
    try:
        model(torch.ones(1, 4))
    except RuntimeError as exc:
        checker.check("previous backward" in str(exc), f"next forward after a failed backward: {exc}")
    model(torch.ones(1, 4)).sum().backward()
    checker.check(all(p.grad is not None for p in model.parameters()), "grads after recovering")


def main():
    group = commlib.init()
    checker = Checker()
    check_mismatched_models(checker, group)
    check_bad_arguments(checker, group)
    check_unused_without_find_unused(checker, group)
    check_backward_without_forward(checker, group)
    check_forward_twice(checker, group)
    check_hook_failure_then_forward(checker, group)
    check_comm_failure_surfaces(checker, group)
    checker.finish()


if __name__ == "__main__":
    main()
