"""Single-process references for DiLoCo, Streaming DiLoCo and DES-LOC: P workers simulated in one
process on the same data as the ranks, written plainly from the papers' formulas (float64).

The optimizers are written out too (AdamW, Adam, SGD with Nesterov momentum, as torch documents
them; :mod:`tests.unit.test_low_communication_units` checks them against torch's), so a
reference shares no code with ``ddp.low_communication`` and the optimizers it hooks.

``steps_of[r]`` is how many batches worker ``r`` has (uneven inputs: a worker that ran out joins,
contributes nothing and is not counted in the averages; under DiLoCo it still applies what the
others' synchronisations produce, under DES-LOC it keeps its own); at the end of uneven inputs
every worker takes the parameters of the highest-numbered worker among those with the most
batches, as ``ddp.Join`` does.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

Params = List[torch.Tensor]


def gradients(module: torch.nn.Module, params: Params, x, y) -> Params:
    """d mse(module(x), y) / d params, with ``params`` in place of the module's own."""
    names = [name for name, _ in module.named_parameters()]
    leaves = [p.detach().clone().requires_grad_(True) for p in params]
    output = torch.func.functional_call(module, dict(zip(names, leaves)), (x,))
    return list(torch.autograd.grad(F.mse_loss(output, y), leaves))


def adam_step(params: Params, grads: Params, state: Dict, *, lr, betas=(0.9, 0.999), eps=1e-8,
              weight_decay=0.0, decoupled: bool = True) -> None:
    """One step of AdamW (``decoupled``) or Adam with L2 ``weight_decay``; state: t, m, v."""
    beta1, beta2 = betas
    state["t"] = state.get("t", 0) + 1
    t = state["t"]
    state.setdefault("m", [torch.zeros_like(p) for p in params])
    state.setdefault("v", [torch.zeros_like(p) for p in params])
    for index, (param, grad) in enumerate(zip(params, grads)):
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        elif weight_decay:
            grad = grad + weight_decay * param
        m = state["m"][index] = beta1 * state["m"][index] + (1 - beta1) * grad
        v = state["v"][index] = beta2 * state["v"][index] + (1 - beta2) * grad * grad
        m_hat_step = lr / (1 - beta1 ** t)
        denominator = v.sqrt() / math.sqrt(1 - beta2 ** t) + eps
        param.sub_(m_hat_step * m / denominator)


def nesterov_step(params: Params, grads: Params, state: Dict, *, lr, momentum) -> None:
    """SGD with Nesterov momentum (torch's form: b = mu b + g; step g + mu b)."""
    for index, (param, grad) in enumerate(zip(params, grads)):
        buffer = state.get(index)
        buffer = grad.clone() if buffer is None else momentum * buffer + grad
        state[index] = buffer
        param.sub_(lr * (grad + momentum * buffer))


def total(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum, left to right."""
    result = tensors[0]
    for tensor in tensors[1:]:
        result = result + tensor
    return result


def _source(steps_of: Sequence[int]) -> int:
    most = max(steps_of)
    return max(r for r, steps in enumerate(steps_of) if steps == most)


def diloco(module: torch.nn.Module, batch: Callable, steps_of: Sequence[int], *, sync_every: int,
           fragments: Sequence[Sequence[int]], delay: int = 0, alpha: float = 0.0, inner: Dict,
           outer_lr: float, outer_momentum: float, wire_dtype: Optional[torch.dtype] = None,
           warmup: int = 0) -> List[List[Params]]:
    """Every worker's parameters after each step (a list per step of lists per worker).

    ``fragments``: parameter indices of each fragment; fragment i lands after steps t with
    (t - 1) % H + 1 == floor((i + 1) H / F) and is sent ``delay`` steps earlier. The first
    ``warmup`` steps are synchronous data parallelism (the workers' gradients averaged)."""
    P = len(steps_of)
    initial = [p.detach().clone() for p in module.parameters()]
    local = [[p.clone() for p in initial] for _ in range(P)]
    inner_state: List[Dict] = [{} for _ in range(P)]
    outer_state: Dict = {}
    offsets = [((i + 1) * sync_every) // len(fragments) for i in range(len(fragments))]
    global_: Params = [p.clone() for p in initial]  # after the warm-up: the workers' common parameters
    pending = None
    trajectory = []
    for step in range(1, max(steps_of) + 1):
        active = [r for r in range(P) if steps_of[r] >= step]
        grads = {r: gradients(module, local[r], *batch(step - 1, r)) for r in active}
        if step <= warmup:
            mean = [total([grads[r][j] for r in active]) / P for j in range(len(initial))]
            grads = dict.fromkeys(active, mean)
        for r in active:
            adam_step(local[r], grads[r], inner_state[r], **inner)
        if step <= warmup:
            trajectory.append([[p.clone() for p in worker] for worker in local])
            if step == warmup:
                global_ = [p.clone() for p in local[0]]
            continue
        position = (step - warmup - 1) % sync_every + 1
        for index, offset in enumerate(offsets):
            if offset - delay == position:
                deltas = []
                for j in fragments[index]:
                    contributions = [((global_[j] - local[r][j]) / len(active)) for r in active]
                    if wire_dtype is not None:  # the sum runs in the wire dtype
                        contributions = [c.to(wire_dtype) for c in contributions]
                    deltas.append(total(contributions).to(global_[j].dtype))
                pending = (index, deltas)
        if pending is not None and offsets[pending[0]] == position:
            index, deltas = pending
            new = [global_[j].clone() for j in fragments[index]]
            nesterov_step(new, deltas, outer_state.setdefault(index, {}), lr=outer_lr, momentum=outer_momentum)
            for j, value in zip(fragments[index], new):
                global_[j] = value
                for r in range(P):
                    local[r][j] = value + alpha * (local[r][j] - value)
            pending = None
        trajectory.append([[p.clone() for p in worker] for worker in local])
    if len(set(steps_of)) > 1:  # uneven inputs: ddp.Join's end
        source = _source(steps_of)
        trajectory[-1] = [[p.clone() for p in local[source]] for _ in range(P)]
    return trajectory


def desloc(module: torch.nn.Module, batch: Callable, steps_of: Sequence[int], *, periods: Sequence[int],
           adam: Dict) -> List[List[Dict]]:
    """Per step, every worker's {"params", "m", "v"} under DES-LOC with periods (Kx, Ku, Kv)."""
    P = len(steps_of)
    initial = [p.detach().clone() for p in module.parameters()]
    local = [[p.clone() for p in initial] for _ in range(P)]
    state: List[Dict] = [{} for _ in range(P)]
    trajectory = []
    for step in range(1, max(steps_of) + 1):
        active = [r for r in range(P) if steps_of[r] >= step]
        for r in active:
            adam_step(local[r], gradients(module, local[r], *batch(step - 1, r)), state[r], **adam)
        for kind, period in zip(("params", "m", "v"), periods):
            if step % period:
                continue
            views = [local[r] if kind == "params" else state[r][kind] for r in range(P)]
            for j in range(len(initial)):
                average = total([views[r][j] / len(active) for r in active])
                for r in active:  # a worker that ran out keeps its own
                    views[r][j] = average.clone()
        trajectory.append([{"params": [p.clone() for p in local[r]], "m": [m.clone() for m in state[r]["m"]],
                            "v": [v.clone() for v in state[r]["v"]]} for r in range(P)])
    if len(set(steps_of)) > 1:
        source = _source(steps_of)
        trajectory[-1] = [dict(trajectory[-1][r], params=[p.clone() for p in local[source]]) for r in range(P)]
    return trajectory
