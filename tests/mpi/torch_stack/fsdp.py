"""FSDP2 (``fully_shard``) on the backend, against the same training on gloo, bit for bit.

Configurations: per-layer and root sharding with ``reshard_after_forward`` True and False,
gradient accumulation (``set_requires_gradient_sync(False)`` on the first microbatch), mixed
precision (bfloat16 parameters, float32 or bfloat16 reduction), a gradient divide factor (FSDP2
reduce-scatters with PREMUL_SUM, which gloo cannot: gloo sums and divides after, the same
exact arithmetic here), HSDP on a 2x2 (replicate x shard) mesh at P=4; and torch's
ZeroRedundancyOptimizer under DDP. Each trains a few Adam steps on per-rank data; parameters and
optimizer state must be the same bits on both backends, must have changed, and the commlib
groups must have run the collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.mpi.torch_stack.common import grid_mlp, meshes, same_bits, same_state, seq_of

STEPS = 3
BF16_PARAMS = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16_ALL = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
CONFIGS = {  # name -> fully_shard keywords, microbatches per step, gradient divide factor
    "reshard_after_forward": (dict(reshard_after_forward=True), 1, None),
    "keep_after_forward": (dict(reshard_after_forward=False), 1, None),
    "gradient_accumulation": (dict(), 2, None),
    "bf16_params_fp32_reduce": (dict(mp_policy=BF16_PARAMS), 1, None),
    "bf16_params_bf16_reduce": (dict(mp_policy=BF16_ALL), 1, None),
    "divide_factor": (dict(), 1, 8.0),
}


def shard_and_train(mesh, keywords, microbatches=1, divide_factor=None, sum_for_comms=False):
    """A grid MLP sharded per layer and at the root on ``mesh``, trained STEPS Adam steps."""
    model = grid_mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, **keywords)
    fully_shard(model, mesh=mesh, **keywords)
    if divide_factor is not None:
        model.set_gradient_divide_factor(divide_factor)
        model.set_force_sum_reduction_for_comms(sum_for_comms)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        for micro in range(microbatches):
            model.set_requires_gradient_sync(micro == microbatches - 1)
            x, y = torch.randn(4, 8, generator=data), torch.randn(4, 8, generator=data)
            dtype = keywords["mp_policy"].param_dtype if "mp_policy" in keywords else torch.float32
            loss = (model(x.to(dtype)).float() - y).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _compare(checker, what, trained, initial):
    (ours, our_optimizer), (theirs, their_optimizer) = trained["commlib"], trained["gloo"]
    ours_params = [p.full_tensor() for p in ours.parameters()]
    for index, (a, b) in enumerate(zip(ours_params, (p.full_tensor() for p in theirs.parameters()))):
        same_bits(checker, a.detach(), b.detach(), f"FSDP2 {what}: parameter {index}")
    changed = any(not torch.equal(a, b) for a, b in zip(ours_params, initial))
    checker.check(changed, f"FSDP2 {what}: training did not change the parameters")
    same_state(checker, our_optimizer.state_dict()["state"], their_optimizer.state_dict()["state"],
               f"FSDP2 {what}: Adam state")


def check_fsdp(checker):
    size = dist.get_world_size()
    flat = meshes((size,))
    initial = [p.detach().clone() for p in grid_mlp().parameters()]
    for what, (keywords, microbatches, factor) in CONFIGS.items():
        before = seq_of(flat["commlib"])
        trained = {name: shard_and_train(mesh, keywords, microbatches, factor, sum_for_comms=name == "gloo")
                   for name, mesh in flat.items()}
        # per step: an all-gather per layer forward (and backward where resharded), a reduce-scatter per layer
        checker.check(seq_of(flat["commlib"]) - before >= 2 * STEPS * 3,
                      lambda what=what, before=before:
                      f"FSDP2 {what}: {seq_of(flat['commlib']) - before} collectives on the commlib group")
        _compare(checker, what, trained, initial)
    if size == 4:
        both = meshes((2, 2), ("replicate", "shard"))
        before = [seq_of(both["commlib"], dim) for dim in (0, 1)]
        trained = {name: shard_and_train(mesh, {}) for name, mesh in both.items()}
        ran = [seq_of(both["commlib"], dim) - before[dim] for dim in (0, 1)]
        checker.check(min(ran) >= STEPS * 3, f"HSDP: collectives on the commlib groups (replicate, shard): {ran}")
        _compare(checker, "HSDP 2x2", trained, initial)
    _check_zero(checker)


def _check_zero(checker):
    """torch's ZeroRedundancyOptimizer (each rank steps its share, then broadcasts it) under DDP."""
    gloo = dist.new_group(backend="gloo")
    results = {}
    for name, group in (("commlib", None), ("gloo", gloo)):
        model = DDP(grid_mlp(), process_group=group)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-2,
                                            process_group=group)
        data = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(STEPS):
            x, y = torch.randn(4, 8, generator=data), torch.randn(4, 8, generator=data)
            (model(x) - y).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        optimizer.consolidate_state_dict(to=0)
        state = optimizer.state_dict() if dist.get_rank() == 0 else None
        results[name] = ([p.detach().clone() for p in model.parameters()], state)
    for index, (a, b) in enumerate(zip(results["commlib"][0], results["gloo"][0])):
        same_bits(checker, a, b, f"ZeroRedundancyOptimizer: parameter {index}")
    if dist.get_rank() == 0:
        same_state(checker, results["commlib"][1]["state"], results["gloo"][1]["state"],
                   "ZeroRedundancyOptimizer: consolidated Adam state")
