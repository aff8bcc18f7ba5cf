"""PYTHONPATH=. mpiexec -n P python tests/mpi/efficient_dp_powersgd_ranks.py

Our PowerSGD hooks under real collectives (float64):

* exactness: with rank >= min(n, m) for every matrix (and ``min_compression_rate=0`` so that
  every tensor, biases and a 4-d convolution weight included, is compressed), the decompressed
  gradients equal the plain average (1e-6), for several steps of error feedback and warm start;
  compression must really have run (from ``start_powerSGD_iter=2``);
* bytes: ``last_step_stats()["bytes_sent"]`` is the gradient size before the start and exactly
  sum((n + m) r) + uncompressed elements, times 8 bytes, after it (several buckets, a mix of
  compressed and uncompressed tensors), written out here independently of the hook's code;
* torch: on the same model, data and initial weights, our DDP with our ``powerSGD_hook`` ends
  with the same parameters as torch's DDP with torch's ``powerSGD_hook`` on the "commlib"
  backend (one bucket each, so that the buckets, their order and hence the random Q factors are
  the same). Tolerance: rtol 1e-9. Both compute the
  same float64 products in possibly different summation orders (bmm vs mm kernels, a P=3
  average as SUM/3 vs torch's x/3 summed); each differs by ~1e-16 relative per step, and
  orthogonalising a rank-2 P amplifies that by at most its condition number (small for random
  data), so 10 steps stay far below 1e-9, while a real difference in the algorithm (another
  random Q, no error feedback, no warm start) moves parameters by 1e-3 or more (checked: the
  run without error feedback must differ by more than 1e-6);
* ``batched_powerSGD_hook`` (torch's cannot run in torch 2.13): exact at full rank, and its bytes.
"""



import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import autograd_bridge
import commlib
from ddp import DistributedDataParallel as DDP
from ddp.hooks import PowerSGDState, batched_powerSGD_hook, powerSGD_hook
from tests.support.verdict import Checker

torch.set_num_threads(1)


class Net(torch.nn.Module):
    """A convolution (4-d weight), linear layers of several shapes, a 0-d scale (torch's hook fails
    on 0-d parameters: ``tensor.shape[0]``, so the comparison with torch leaves it out)."""

    def __init__(self, scale=True):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.fc1 = torch.nn.Linear(4 * 4 * 4, 24)
        self.fc2 = torch.nn.Linear(24, 24)
        self.out = torch.nn.Linear(24, 5)
        self.scale = torch.nn.Parameter(torch.tensor(1.5)) if scale else None

    def forward(self, x):
        h = torch.relu(self.conv(x.view(-1, 2, 6, 6))).flatten(1)
        out = self.out(torch.tanh(self.fc2(torch.tanh(self.fc1(h)))))
        return out * self.scale if self.scale is not None else out


def batch(step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(6, 72, generator=generator, dtype=torch.float64),
            torch.randn(6, 5, generator=generator, dtype=torch.float64))


def average_grads(group, model, step):
    """The plain average of every rank's gradient at this step (each rank computes all of them)."""
    reference = Net().double()
    reference.load_state_dict(model.module.state_dict())
    for rank in range(group.size):
        x, y = batch(step, rank)
        (F.mse_loss(reference(x), y) / group.size).backward()
    return [p.grad for p in reference.parameters()]


def check_full_rank_is_exact(check, group):
    model = DDP(Net().double(), bucket_cap_mb=0.004, first_bucket_cap_mb=0.004)
    state = PowerSGDState(None, matrix_approximation_rank=64, start_powerSGD_iter=2, min_compression_rate=0)
    model.register_comm_hook(state, powerSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(6):
        expected = average_grads(group, model, step)
        optimizer.zero_grad()
        x, y = batch(step, group.rank)
        F.mse_loss(model(x), y).backward()
        for (name, p), want in zip(model.module.named_parameters(), expected):
            check.close(p.grad, want, f"rank >= min(n, m), step {step}: grad of {name}", rtol=1e-6, atol=1e-9)
        optimizer.step()
    compressed = [key for key in state.q_memory_dict if isinstance(key, int)]
    check.check(state.iter == 6 and len(compressed) == len(list(model.parameters())) - 1,
                f"compression did not run on every tensor: iter {state.iter}, Q factors for {compressed}")
    check.check(len(model.bucket_sizes()) >= 2, f"{len(model.bucket_sizes())} bucket(s): the test wants several")


def expected_payload(model, rank, min_rate):
    """sum((n + m) r) over the compressed matrices + the other elements, written out on its own."""
    elements = 0
    for p in model.parameters():
        if p.dim() == 0:
            elements += 1
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank)
        elements += (n + m) * r if (n + m) * r * min_rate < n * m else n * m
    return elements * 8


def check_bytes(check, group):
    for rank, min_rate in ((1, 2), (2, 2), (4, 1)):
        model = DDP(Net().double(), bucket_cap_mb=0.004, first_bucket_cap_mb=0.004)
        model.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                               min_compression_rate=min_rate), powerSGD_hook)
        full = sum(p.numel() for p in model.parameters()) * 8
        expected = expected_payload(model.module, rank, min_rate)
        for step in range(4):
            x, y = batch(step, group.rank)
            F.mse_loss(model(x), y).backward()
            sent = model.last_step_stats()["bytes_sent"]
            want = full if step < 2 else expected
            check.check(sent == want, f"rank {rank}, min rate {min_rate}, step {step}: bytes_sent {sent}, "
                        f"expected {want} (full {full})")
        check.check(expected < full, f"rank {rank}: the formula gives no saving ({expected} >= {full})")


def torch_model():
    return torch.nn.parallel.DistributedDataParallel(Net(scale=False).double(), bucket_cap_mb=25)


def train(model, steps, rank):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(step, rank)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    module = model.module
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy()


def check_equals_torch(check, group):
    steps = 10
    options = dict(matrix_approximation_rank=2, start_powerSGD_iter=2)
    theirs = torch_model()
    theirs.register_comm_hook(torch_powersgd.PowerSGDState(None, **options), torch_powersgd.powerSGD_hook)
    ours = DDP(Net(scale=False).double(), bucket_cap_mb=25, first_bucket_cap_mb=25)
    ours.register_comm_hook(PowerSGDState(None, **options), powerSGD_hook)
    theirs_params = train(theirs, steps, group.rank)
    ours_params = train(ours, steps, group.rank)
    check.check(len(ours.bucket_sizes()) == 1, f"ours has {len(ours.bucket_sizes())} buckets, expected 1")
    check.close(ours_params, theirs_params, f"powerSGD_hook: ours vs torch's after {steps} steps",
                rtol=1e-9, atol=1e-12)
    other = DDP(Net(scale=False).double(), bucket_cap_mb=25, first_bucket_cap_mb=25)
    other.register_comm_hook(PowerSGDState(None, use_error_feedback=False, **options), powerSGD_hook)
    different = train(other, steps, group.rank)
    check.check(np.abs(different - theirs_params).max() > 1e-6,
                "without error feedback the result is as close to torch's: the comparison cannot tell")


def check_batched(check, group):
    """torch 2.13's own batched_powerSGD_hook cannot run (it resize_()s DDP's bucket view, and its
    _orthogonalize asserts a 3-d input it is given 2-d), so ours is checked against the plain
    average at full rank (side x side factors: exact), and for its bytes (2 side r elements)."""
    for rank in (None, 1):
        model = DDP(Net().double(), bucket_cap_mb=25, first_bucket_cap_mb=25)
        numel = sum(p.numel() for p in model.parameters())
        side = int(np.ceil(np.sqrt(numel)))
        state = PowerSGDState(None, matrix_approximation_rank=rank or side, start_powerSGD_iter=2)
        model.register_comm_hook(state, batched_powerSGD_hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(5):
            expected = average_grads(group, model, step)
            optimizer.zero_grad()
            x, y = batch(step, group.rank)
            F.mse_loss(model(x), y).backward()
            sent = model.last_step_stats()["bytes_sent"]
            want = numel * 8 if step < 2 else 2 * side * (rank or side) * 8
            check.check(sent == want, f"batched rank {rank or side}, step {step}: bytes_sent {sent}, expected {want}")
            if rank is None:
                for (name, p), want_grad in zip(model.module.named_parameters(), expected):
                    check.close(p.grad, want_grad, f"batched full rank, step {step}: grad of {name}", rtol=1e-6,
                                atol=1e-9)
            optimizer.step()
        check.check(("bucket", 0) in state.q_memory_dict, "batched: no Q factor: compression did not run")


def main():
    autograd_bridge.init_process_group()
    group = commlib.world()
    check = Checker()
    check_full_rank_is_exact(check, group)
    check_bytes(check, group)
    check_equals_torch(check, group)
    check_batched(check, group)
    dist.destroy_process_group()
    check.finish()


if __name__ == "__main__":
    main()
