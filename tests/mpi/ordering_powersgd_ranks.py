"""PYTHONPATH=. mpiexec -n P python tests/mpi/ordering_powersgd_ranks.py

torch's own DDP on the "commlib" backend with torch's own ``powerSGD_hook`` and six buckets in
flight: every bucket's hook chains two more allreduces (P, then Q) from future callbacks while
the autograd thread launches the next bucket. PowerSGD's decompressed gradient is the same on
every rank by construction, so the ranks must end with identical parameters; a runtime that let
the callbacks' collectives race the next bucket's launch paired different collectives across
ranks (measured before the ordering rule: ranks diverged in 6 runs of 6 at P=2 and P=3).

Checked, bitwise: the ranks agree; three fresh repetitions in one job agree; and the overlapped
run equals a serialized reference (a hook that waits for each bucket's whole chain before the
next bucket can launch), so the order is not merely consistent but the obvious one.
"""



import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import autograd_bridge
from tests.support.verdict import Checker

torch.set_num_threads(1)
STEPS = 20
WIDTHS = [32, 64, 64, 64, 64, 64, 64, 8]  # 7 Linear layers: 6 buckets of ~0.02 MiB in float64


def mlp():
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(WIDTHS, WIDTHS[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).double()


def serialized(hook):
    """The reference: each bucket's whole chain completes before the hook returns."""
    def waiting_hook(state, bucket):
        future = hook(state, bucket)
        future.wait()
        return future
    return waiting_hook


def train(rank, hook):
    model = DDP(mlp(), bucket_cap_mb=0.02)
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                   start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
    model.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x = torch.randn(16, WIDTHS[0], generator=data, dtype=torch.float64)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    buckets = model._get_ddp_logging_data().get("num_buckets_reduced", 0)
    compressed = len(state.p_memory_dict)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), buckets, compressed


def main():
    autograd_bridge.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    check = Checker()
    runs = [train(rank, powersgd.powerSGD_hook) for _ in range(3)]
    reference, _, _ = train(rank, serialized(powersgd.powerSGD_hook))
    first, buckets, compressed = runs[0]
    check.check(buckets >= 6, f"{buckets} buckets reduced; the test needs at least 6 in flight")
    check.check(compressed >= 5, f"PowerSGD compressed {compressed} buckets; expected it to run")
    for index, (params, _, _) in enumerate(runs[1:], start=2):
        check.equal(params.numpy(), first.numpy(), f"repetition {index} vs repetition 1")
    check.equal(first.numpy(), reference.numpy(), "overlapped buckets vs the serialized reference")
    everyone = [torch.empty_like(first) for _ in range(size)]
    dist.all_gather(everyone, first)
    for other, params in enumerate(everyone):
        check.equal(params.numpy(), first.numpy(), f"rank {other}'s parameters vs rank {rank}'s")
    check.check(not torch.equal(first, torch.cat([p.flatten() for p in mlp().parameters()]).detach()),
                "parameters did not move")
    dist.destroy_process_group()
    check.finish()


if __name__ == "__main__":
    main()
