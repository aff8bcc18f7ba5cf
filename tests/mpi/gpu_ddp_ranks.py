"""PYTHONPATH=. mpiexec -n 2 python tests/mpi/gpu_ddp_ranks.py [host_staged|nccl]

DDP on CUDA tensors (the reducer's buckets go through commlib's GPU backend, comm stream and
events) against one process on the whole batch, on the same GPU: same initial weights, same SGD,
gradients and parameters allclose after a few steps. Host-staged by default, so several ranks
can share one GPU.
"""

import sys

import torch
import torch.nn.functional as F

import commlib
from commlib.gpu import attach
from ddp import DistributedDataParallel as DDP
from tests.support.verdict import Checker

STEPS = 4
SHARD = 4


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4)).cuda()


def batch(step, size):
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(size * SHARD, 12, generator=generator)
    return x.cuda(), torch.randn(size * SHARD, 4, generator=generator).cuda()


def run_case(check, pg, cap, as_view):
    torch.manual_seed(0)
    reference = make_model()
    torch.manual_seed(100 + pg.rank)  # DDP must broadcast rank 0's weights
    local = make_model()
    if pg.rank == 0:
        local.load_state_dict(reference.state_dict())
    model = DDP(local, bucket_cap_mb=cap, first_bucket_cap_mb=cap, gradient_as_bucket_view=as_view)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    rows = slice(pg.rank * SHARD, (pg.rank + 1) * SHARD)
    what = f"cap={cap}MB as_view={as_view}"
    for step in range(STEPS):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = batch(step, pg.size)
        F.mse_loss(model(x[rows]), y[rows]).backward()
        F.mse_loss(reference(x), y).backward()
        for (name, p), q in zip(local.named_parameters(), reference.parameters()):
            check.close(p.grad.cpu(), q.grad.cpu(), f"{what} step {step}: grad {name}", rtol=1e-4, atol=1e-6)
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(local.named_parameters(), reference.parameters()):
        check.close(p.detach().cpu(), q.detach().cpu(), f"{what}: {name} after {STEPS} steps", rtol=1e-4, atol=1e-6)


def main():
    transport = sys.argv[1] if len(sys.argv) > 1 else "host_staged"
    torch.cuda.set_device(0)
    pg = commlib.init(timeout=120)
    attach(pg, transport)
    check = Checker()
    for cap in (1e-6, 25):
        for as_view in (False, True):
            run_case(check, pg, cap, as_view)
    check.finish()


if __name__ == "__main__":
    main()
