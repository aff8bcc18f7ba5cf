"""PYTHONPATH=. mpiexec -n P python tests/mpi/ddp_equivalence_ranks.py [model ...]

P ranks with DDP, each on its shard of the batch, against one process on the whole batch (every
rank computes that reference itself): same initial weights, same SGD with momentum, parameters
allclose (fp32, rtol 1e-5) after a few steps. Every model runs with bucket caps from "one bucket
per parameter" to "one bucket for all", and with gradient_as_bucket_view both ways. The DDP
replica starts from rank-dependent weights, so construction must broadcast rank 0's.
"""

import sys

import torch
import torch.nn.functional as F

import commlib
from ddp import DistributedDataParallel as DDP
from tests.support.verdict import Checker

torch.set_num_threads(1)
STEPS = 4          # the buckets are rebuilt after step 1: later steps run on the rebuilt plan
SHARD = 3          # samples per rank
CAPS_MB = (1e-6, 0.0005, 25)   # every param alone / a few per bucket / all in one
MICRO = 3          # no_sync: micro-batches per optimizer step


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                       torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def forward(self, x, step=0):
        return self.net(x)


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 4 * 4, 4)

    def forward(self, x, step=0):
        return self.fc(F.relu(self.bn(self.conv(x.view(-1, 2, 6, 6)))).flatten(1))


class Tied(torch.nn.Module):
    """One weight in two modules, and one module applied twice."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(12, 12)
        self.mid = torch.nn.Linear(12, 12)
        self.out = torch.nn.Linear(12, 4)
        self.mid.weight = self.inp.weight

    def forward(self, x, step=0):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(h))
        return self.out(torch.tanh(self.inp(h)))


class Branchy(torch.nn.Module):
    """`never` takes no part in any loss; `sometimes` only on even steps."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(12, 16)
        self.never = torch.nn.Linear(16, 16)
        self.sometimes = torch.nn.Linear(16, 4)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x, step=0):
        h = torch.relu(self.body(x))
        out = self.head(h)
        if step % 2 == 0:
            out = out + self.sometimes(h)
        return out


MODELS = {"mlp": (MLP, {}), "cnn_bn": (CNN, {}), "tied": (Tied, {}),
          "unused": (Branchy, {"find_unused_parameters": True}), "no_sync": (MLP, {})}


def batch(name: str, step: int, micro: int, size: int):
    """The global batch of (step, micro-batch); rank r's shard is rows [r*SHARD, (r+1)*SHARD)."""
    generator = torch.Generator().manual_seed(1000 * step + micro)
    features = 72 if name == "cnn_bn" else 12
    x = torch.randn(size * SHARD, features, generator=generator)
    return x, torch.randn(size * SHARD, 4, generator=generator)


def reference_step(model, name, step, size):
    """One optimizer step's gradients on one process, over the whole (global) batch."""
    micros = MICRO if name == "no_sync" else 1
    for micro in range(micros):
        x, y = batch(name, step, micro, size)
        if name == "cnn_bn":
            # BatchNorm normalises over the batch it sees: the single-process equivalent of P
            # ranks is one forward per shard, loss averaged over shards. Running stats follow
            # rank 0's (DDP broadcasts rank 0's buffers before each forward).
            for shard in range(size):
                saved = [b.clone() for b in model.buffers()]
                rows = slice(shard * SHARD, (shard + 1) * SHARD)
                (F.mse_loss(model(x[rows], step), y[rows]) / size).backward()
                if shard != 0:
                    for buffer, value in zip(model.buffers(), saved):
                        buffer.copy_(value)
        else:
            F.mse_loss(model(x, step), y).backward()


def ddp_step(model, name, step, rank, size):
    micros = MICRO if name == "no_sync" else 1
    rows = slice(rank * SHARD, (rank + 1) * SHARD)
    for micro in range(micros):
        x, y = batch(name, step, micro, size)
        if micro < micros - 1:
            with model.no_sync():
                F.mse_loss(model(x[rows], step), y[rows]).backward()
        else:
            F.mse_loss(model(x[rows], step), y[rows]).backward()


def run_case(checker, group, name, cap, as_view):
    cls, options = MODELS[name]
    torch.manual_seed(0)
    reference = cls()
    torch.manual_seed(100 + group.rank)  # DDP must replace these with rank 0's (seed 0) weights
    local = cls()
    if group.rank == 0:
        local.load_state_dict(reference.state_dict())
    model = DDP(local, bucket_cap_mb=cap, first_bucket_cap_mb=cap, gradient_as_bucket_view=as_view, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    what = f"{name} cap={cap}MB as_view={as_view}"
    for step in range(STEPS):
        set_to_none = step % 2 == 0
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=set_to_none)
        ddp_step(model, name, step, group.rank, group.size)
        reference_step(reference, name, step, group.size)
        for (pname, p), q in zip(local.named_parameters(), reference.parameters()):
            if step not in (0, STEPS - 1):
                break  # the first step (initial plan) and the last (rebuilt plan) are enough
            checker.check((p.grad is None) == (q.grad is None),
                          f"{what} step {step}: {pname}.grad is None on one side only")
            if p.grad is not None and q.grad is not None:
                checker.close(p.grad, q.grad, f"{what} step {step}: grad of {pname}", rtol=1e-5, atol=1e-6)
        opt.step()
        ref_opt.step()
    for (pname, p), q in zip(local.named_parameters(), reference.parameters()):
        checker.close(p.detach(), q.detach(), f"{what}: {pname} after {STEPS} steps", rtol=1e-5, atol=1e-6)
    if group.rank == 0:
        for (bname, b), c in zip(local.named_buffers(), reference.buffers()):
            checker.close(b, c, f"{what}: buffer {bname} on rank 0", rtol=1e-5, atol=1e-6)
    if as_view:
        for p in local.parameters():
            if p.grad is not None:
                checker.check(any(p.grad.data_ptr() >= b.flat.data_ptr() and
                                  p.grad.data_ptr() < b.flat.data_ptr() + b.nbytes
                                  for b in model.reducer.buckets),
                              f"{what}: with gradient_as_bucket_view a .grad is not a bucket view")
    checker.check(model.last_step_stats() is not None and model.last_step_stats()["buckets"] >= 1,
                  f"{what}: no step statistics recorded")


def main():
    group = commlib.init()
    checker = Checker()
    names = sys.argv[1:] or list(MODELS)
    for name in names:
        for cap in CAPS_MB:
            for as_view in (False, True):
                run_case(checker, group, name, cap, as_view)
    checker.finish()


if __name__ == "__main__":
    main()
