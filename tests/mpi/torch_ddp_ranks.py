"""PYTHONPATH=. mpiexec -n P python tests/mpi/torch_ddp_ranks.py

torch's own DDP over the "commlib" backend vs over gloo, same seed and data, in one job.

    PYTHONPATH=. mpiexec -n 2 python tests/mpi/torch_ddp_ranks.py      # bitwise equal at P=2
    PYTHONPATH=. mpiexec -n 3 python tests/mpi/torch_ddp_ranks.py      # allclose at P=3 (sum order differs)

Each configuration trains two copies of one model (different initial weights per rank, so DDP's
initial broadcast matters; a BatchNorm, so buffers are broadcast every step) for a few steps,
one copy over the default "commlib" group, one over a gloo group, and compares every parameter
and buffer. A sum of two floats is the same whichever order it is done in, so at P=2 the two
backends must agree to the bit; at P=3 the reduction order is the library's choice.
"""



import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

import autograd_bridge
from tests.support.verdict import Checker

torch.set_num_threads(1)
STEPS = 5

# name -> (DDP keyword arguments, comm hook, model has a parameter it never uses)
CONFIGS = {
    "plain": (dict(bucket_cap_mb=0.002), None, False),
    "gradient_as_bucket_view": (dict(bucket_cap_mb=0.002, gradient_as_bucket_view=True), None, False),
    "find_unused_parameters": (dict(bucket_cap_mb=0.002, find_unused_parameters=True), None, True),
    "static_graph": (dict(bucket_cap_mb=0.002, static_graph=True), None, True),
    "fp16_compress_hook": (dict(bucket_cap_mb=0.002), "fp16", False),
    # One bucket: the reference, gloo, hangs with several buckets in flight (PowerSGD's callback
    # collectives race the next bucket's launch there); ours with six: ordering_powersgd_ranks.py.
    "powerSGD_hook": (dict(bucket_cap_mb=25), "powersgd", False),
}


class Net(torch.nn.Module):
    def __init__(self, with_unused: bool):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 24)
        self.bn = torch.nn.BatchNorm1d(24)
        self.fc2 = torch.nn.Linear(24, 16)
        self.fc3 = torch.nn.Linear(16, 3)
        self.unused = torch.nn.Linear(5, 5) if with_unused else None

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.bn(self.fc1(x))))))


def train(config, group, rank):
    kwargs, hook, with_unused = CONFIGS[config]
    torch.manual_seed(1000 + rank)  # different weights per rank: DDP's broadcast must fix that
    model = DDP(Net(with_unused), process_group=group, **kwargs)
    if hook == "fp16":
        model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif hook == "powersgd":
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=0.5)
        model.register_comm_hook(state, powersgd.powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(7 + rank)
    for _ in range(STEPS):
        x = torch.randn(6, 12, generator=data)
        optimizer.zero_grad(set_to_none=False)
        model(x).pow(2).mean().backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.module.state_dict().items()}


def main():
    autograd_bridge.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    checker = Checker()
    bitwise = size <= 2
    checker.check(dist.get_backend() == "commlib", f"default backend is {dist.get_backend()!r}")
    for config in CONFIGS:
        ours = train(config, None, rank)
        reference = train(config, gloo, rank)
        for name, value in reference.items():
            what = f"{config}: {name} after {STEPS} steps, commlib vs gloo"
            if bitwise:
                checker.equal(ours[name].numpy(), value.numpy(), what)
            else:
                # fp16 sums of three terms round differently in another order: ~1e-3 relative.
                rtol, atol = (3e-3, 3e-5) if config == "fp16_compress_hook" else (1e-4, 1e-6)
                checker.close(ours[name].numpy(), value.numpy(), what, rtol=rtol, atol=atol)
        # DDP's invariant, independent of gloo: every rank holds the same parameters (buffers
        # such as BatchNorm's running stats are per rank until the next forward broadcasts them).
        flat = torch.cat([v.double().flatten() for name, v in ours.items() if "running" not in name
                          and "num_batches" not in name])
        everyone = [torch.empty_like(flat) for _ in range(size)]
        dist.all_gather(everyone, flat, group=gloo)
        checker.close(flat.numpy(), everyone[0].numpy(), f"{config}: rank {rank} model vs rank 0's",
                      rtol=1e-6, atol=1e-7)
        checker.check(not torch.equal(ours["fc1.weight"], train_free_init(config, rank)),
                      f"{config}: parameters did not move")
    dist.destroy_process_group()
    checker.finish()


def train_free_init(config, rank):
    torch.manual_seed(1000 + rank)
    return Net(CONFIGS[config][2]).fc1.weight.detach()


if __name__ == "__main__":
    main()
