"""PYTHONPATH=. mpiexec -n 2 python tests/mpi/efficient_dp_resume_ranks.py

A run stopped after 5 steps and resumed from a checkpoint (model, optimizer, hook state and
averager state, through ``torch.save``/``torch.load``, into freshly built objects) ends with the
same parameters, bit for bit, as the run that went straight through 12 steps. For PowerSGD (per-
tensor with and without warm start, and batched: errors, Q factors, the random generator, the
iteration), post-local SGD with the
periodic, hierarchical and partial averagers (step; the partial averager's averaging in flight
at the stop). Each rank keeps its own checkpoint: after local steps the ranks differ.
"""

import io


import torch
import torch.nn.functional as F

import commlib
from ddp import DistributedDataParallel as DDP
from ddp.averaging import HierarchicalModelAverager, PartialModelAverager, PeriodicModelAverager
from ddp.hooks import PostLocalSGDState, PowerSGDState, batched_powerSGD_hook, post_localSGD_hook, powerSGD_hook
from ddp.optim import PostLocalSGDOptimizer
from tests.support.verdict import Checker

torch.set_num_threads(1)
STEPS, STOP, START = 12, 5, 3


def build(method, group):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(10, 24), torch.nn.ReLU(), torch.nn.Linear(24, 24), torch.nn.ReLU(),
                              torch.nn.Linear(24, 4))
    model = DDP(net, bucket_cap_mb=0.002, first_bucket_cap_mb=0.002)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if method.startswith("powersgd") or method == "batched":
        # Without warm start new random Q factors are drawn every step: the generator must resume.
        state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2,
                              warm_start=method != "powersgd_cold")
        model.register_comm_hook(state, batched_powerSGD_hook if method == "batched" else powerSGD_hook)
        return model, optimizer, state
    state = PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False)
    model.register_comm_hook(state, post_localSGD_hook)
    averager = {"localsgd": lambda: PeriodicModelAverager(4, warmup_steps=START),
                "hierarchical": lambda: HierarchicalModelAverager({2: 1, 4: group.size}, warmup_steps=START),
                "partial": lambda: PartialModelAverager(3, warmup_steps=START)}[method]()
    return model, PostLocalSGDOptimizer(optimizer, averager), state


def run(model, optimizer, steps, rank):
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(8, 10, generator=generator), torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()


def params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.module.parameters()]).numpy().copy()


def main():
    group = commlib.init()
    check = Checker()
    for method in ("powersgd", "powersgd_cold", "batched", "localsgd", "hierarchical", "partial"):
        model, optimizer, state = build(method, group)
        run(model, optimizer, range(STEPS), group.rank)
        straight = params(model)

        model, optimizer, state = build(method, group)
        run(model, optimizer, range(STOP), group.rank)
        file = io.BytesIO()
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "hook": state.state_dict()}, file)
        at_stop = params(model)
        del model, optimizer, state

        file.seek(0)
        saved = torch.load(file, weights_only=False)
        model, optimizer, state = build(method, group)  # fresh objects, rank 0's initial weights
        model.module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state.load_state_dict(saved["hook"])
        check.equal(params(model), at_stop, f"{method}: parameters after loading the checkpoint")
        run(model, optimizer, range(STOP, STEPS), group.rank)
        check.equal(params(model), straight, f"{method}: resumed at step {STOP} vs straight through {STEPS}")
    check.finish()


if __name__ == "__main__":
    main()
