"""``FaultTolerantDDP``: data parallelism across replicas that may die and come back.

    manager = commlib.ft.Manager("coordinator:29600", replica_id="host-a")
    model = FaultTolerantDDP(net, manager)
    opt = manager.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

Forward is the module's. The gradients are averaged over the step's quorum when the optimizer
steps (one flat buffer, weighted by each replica's share of the step's samples, then the
manager's allreduce): the average must wait for the commit decision anyway, and one buffer
keeps the replay of a run exact. The model's state (parameters and buffers) is registered with
the manager for catch-up, and this module gives the manager its codec: ``torch.save`` /
``torch.load(weights_only=True)``, which never runs code a peer sent.
"""

from __future__ import annotations

import io
from typing import List

import torch

__all__ = ["FaultTolerantDDP", "TorchCodec", "flatten_gradients", "unflatten_gradients"]


class TorchCodec:
    """State objects (state dicts) to bytes and back, loading tensors and containers only."""

    @staticmethod
    def encode(obj) -> memoryview:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getbuffer()  # the bytes in place, writable: the catch-up sends from them

    @staticmethod
    def decode(data) -> dict:
        return torch.load(io.BytesIO(data), weights_only=True)


def flatten_gradients(params: List[torch.nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient (zeros where there is none) in one contiguous CPU tensor."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).cpu()
                      for p in params])


def unflatten_gradients(params: List[torch.nn.Parameter], flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        count = p.numel()
        value = flat[offset:offset + count].view_as(p).to(p.device)
        if p.grad is None:
            p.grad = value.clone()
        else:
            p.grad.copy_(value)
        offset += count


class FaultTolerantDDP(torch.nn.Module):
    """``module`` trained by the replicas of ``manager``'s quorums (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, manager):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"FaultTolerantDDP: expected a torch.nn.Module, got {type(module).__name__}")
        self.module = module
        self.manager = manager
        self.params = [p for p in module.parameters() if p.requires_grad]
        if manager.codec is None:
            manager.codec = TorchCodec()
        manager.register_state("model", module.state_dict, self._load_model)
        manager.gradient_hooks.append(self.average_gradients)

    def _load_model(self, state) -> None:
        self.module.load_state_dict(state)

    def forward(self, *inputs, **kwargs):
        if torch.is_grad_enabled():
            self.manager.start_step()
        return self.module(*inputs, **kwargs)

    def average_gradients(self) -> None:
        """The gradients become the quorum's (sample-weighted) mean; on failure they are left to
        a step that will not be applied."""
        if not self.params:
            return
        flat = flatten_gradients(self.params)
        self.manager.allreduce_average(flat.numpy(), self.manager.gradient_weight())
        unflatten_gradients(self.params, flat)
