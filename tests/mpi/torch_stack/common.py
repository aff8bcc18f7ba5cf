"""What the torch-stack checks share: the two meshes, exact gradients, bitwise comparisons.

Every check runs the same torch code twice in one job, on a DeviceMesh over the "commlib"
backend and on one over gloo with the same ranks, and compares the results bit for bit.

**Why bitwise holds at any world size.** A float sum of two values is the same in either order,
but a sum of four depends on the order, which is each library's choice. So the models here
round every gradient to a grid before it is reduced (:class:`GridLinear`): multiples of
``2**-10`` below ``2**8`` in float32 (multiples of ``2**-2`` below ``2**3`` in bfloat16). Any sum of
up to 8 such values, and its halves and quarters, is exact, so every correct reduction, in any
order, gives the same bits, and so does the optimizer step that follows on every rank. DTensor
inputs are small integers, exact for the same reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from tests.support.gloo_compare import same_bits

__all__ = ["meshes", "GridLinear", "grid_mlp", "same_bits", "same_state", "full", "integers", "seq_of"]

BACKENDS = ("commlib", "gloo")


def meshes(shape, names=None):
    """{"commlib": mesh, "gloo": mesh} of ``shape`` over the world (commlib is the default group's backend)."""
    gloo = dict.fromkeys(range(len(shape)), "gloo")
    return {"commlib": init_device_mesh("cpu", shape, mesh_dim_names=names),
            "gloo": init_device_mesh("cpu", shape, mesh_dim_names=names, backend_override=gloo)}


class _Grid(torch.autograd.Function):
    """Identity forward; the gradient rounded to multiples of ``step``, clamped to +-``limit``."""

    @staticmethod
    def forward(ctx, tensor, step, limit):
        ctx.step, ctx.limit = step, limit
        return tensor.clone()

    @staticmethod
    def backward(ctx, grad):
        return (torch.round(grad / ctx.step) * ctx.step).clamp(-ctx.limit, ctx.limit), None, None


class GridLinear(torch.nn.Linear):
    """A Linear whose weight and bias gradients land on a grid (see the module docstring)."""

    def forward(self, x):
        low = self.weight.dtype in (torch.bfloat16, torch.float16)
        step, limit = (2.0 ** -2, 2.0 ** 3) if low else (2.0 ** -10, 2.0 ** 8)
        weight = _Grid.apply(self.weight, step, limit)
        bias = _Grid.apply(self.bias, step, limit)
        return F.linear(x, weight, bias)


def grid_mlp(widths=(8, 16, 16, 8), seed=0):
    torch.manual_seed(seed)
    layers = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        layers += [GridLinear(fan_in, fan_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def full(tensor):
    """The whole value of a DTensor (or the tensor itself)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def same_state(checker, ours, theirs, what):
    """Two (nested) state dicts hold the same keys and, tensor by tensor, the same bits."""
    if isinstance(ours, dict):
        checker.check(set(ours) == set(theirs), lambda: f"{what}: keys {sorted(ours)} vs {sorted(theirs)}")
        for key in ours:
            if key in theirs:
                same_state(checker, ours[key], theirs[key], f"{what}.{key}")
    elif isinstance(ours, (list, tuple)):
        checker.check(len(ours) == len(theirs), f"{what}: {len(ours)} vs {len(theirs)} entries")
        for index, (a, b) in enumerate(zip(ours, theirs)):
            same_state(checker, a, b, f"{what}[{index}]")
    elif isinstance(ours, torch.Tensor):
        same_bits(checker, full(ours).detach(), full(theirs).detach(), what)
    else:
        checker.check(ours == theirs, lambda: f"{what}: {ours!r} vs {theirs!r}")


def integers(shape, seed, low=-4, high=5):
    """Small integers as float32, the same on every rank for a seed."""
    return torch.randint(low, high, shape, generator=torch.Generator().manual_seed(seed)).float()


def seq_of(mesh, dim=0):
    """How many collectives the commlib group under ``mesh``'s dim ``dim`` has run (0 for gloo)."""
    group = mesh.get_group(dim)
    commlib_group = getattr(group, "commlib_group", None)
    return commlib_group.seq if commlib_group is not None else 0
