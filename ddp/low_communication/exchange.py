"""Averaging flat buffers over a group: asynchronous, metered, Join-aware, optionally narrower.

The low-communication methods send a few large flat buffers (a fragment's pseudo-gradient, the
parameters, a moment), one per dtype, on the group's communication thread. Each rank divides its
contribution by the number of contributors *before* the sum (a float16 sum over many ranks could
overflow where the average would not, as torch's compression hooks), then casts it to the wire
dtype (``outer_dtype``: bfloat16 halves the bytes of float32). A rank that has joined (``ddp.Join``)
sends zeros of the same size, so the others' sum is the active ranks' alone.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from autograd_bridge.tensors import to_array
from commlib import ReduceOp

from ddp.stats import ByteCounter, MeteredGroup

__all__ = ["Averaging", "Workspace", "start_averaging", "group_by_dtype", "flatten", "flatten_into",
           "unflatten_into"]


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> List[List[int]]:
    """Indices of ``tensors`` by (dtype, device), groups in order of first appearance."""
    keys: dict = {}
    for index, tensor in enumerate(tensors):
        keys.setdefault((tensor.dtype, tensor.device), []).append(index)
    return list(keys.values())


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """A new 1-D tensor holding ``tensors`` (same dtype) one after another."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


@torch.no_grad()
def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
    """``flatten`` into ``flat`` (no new memory); returns it."""
    offset = 0
    for tensor in tensors:
        flat[offset:offset + tensor.numel()].view_as(tensor).copy_(tensor)
        offset += tensor.numel()
    return flat


@torch.no_grad()
def unflatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()


class Workspace:
    """Flat buffers kept from one synchronisation to the next, by key. A fresh tensor of the
    model's size costs its page faults at every synchronisation (about as much as the
    arithmetic on it, measured on a 100 MB model); a kept one costs them once."""

    def __init__(self):
        self._buffers: Dict[Any, torch.Tensor] = {}

    def get(self, key, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer


_Part = Tuple[torch.Tensor, Optional[torch.Tensor], torch.dtype, Any]  # wire, its buffer, the buffer's dtype, work


class Averaging:
    """Buffers on their way: per buffer the wire copy, the buffer it came from (the result is cast
    back into it; None when restored from a checkpoint) and the collective's handle (None once
    waited for)."""

    __slots__ = ("parts", "contributed")

    def __init__(self, parts: List[_Part], contributed: bool):
        self.parts = parts
        self.contributed = contributed

    def wait(self) -> List[torch.Tensor]:
        """The averages, each in the dtype its buffer came in (in that buffer when there is one)."""
        results = []
        for index, (wire, flat, dtype, work) in enumerate(self.parts):
            if work is not None:
                work.wait()
                if flat is not None and flat is not wire:
                    flat.copy_(wire)
                self.parts[index] = (wire, flat, dtype, None)
            results.append(flat if flat is not None else wire.to(dtype))
        return results

    def state_dict(self) -> dict:
        """Waits, then the averages as they came off the wire (a resumed run lands the same bits)."""
        self.wait()
        return {"contributed": self.contributed,
                "parts": [(wire.clone(), str(dtype).removeprefix("torch.")) for wire, _, dtype, _ in self.parts]}

    @classmethod
    def from_state_dict(cls, state: dict) -> "Averaging":
        parts: List[_Part] = [(wire.clone(), None, getattr(torch, dtype), None) for wire, dtype in state["parts"]]
        return cls(parts, state["contributed"])


def start_averaging(flats: Sequence[torch.Tensor], group, *, divisor: int, contribute: bool,
                    counter: ByteCounter, wire_dtype: Optional[torch.dtype] = None, algorithm: str = "auto",
                    workspace: Optional[Workspace] = None, key=None) -> Averaging:
    """Start averaging each of ``flats`` (1-D; consumed: the average lands in it) over ``group``:
    ``divisor`` ranks contribute; this one sends zeros when ``contribute`` is False. A wire dtype
    other than the buffer's goes through a buffer of ``workspace`` (``key``, index)."""
    sender = MeteredGroup(group, counter)
    parts: List[_Part] = []
    with torch.no_grad():
        for index, flat in enumerate(flats):
            if contribute:
                flat.div_(divisor)
            else:
                flat.zero_()
            wire = flat
            if wire_dtype is not None and wire_dtype != flat.dtype:
                wire = (workspace.get((key, index), flat.numel(), wire_dtype, flat.device) if workspace is not None
                        else torch.empty(flat.numel(), dtype=wire_dtype, device=flat.device))
                wire.copy_(flat)
            work = sender.allreduce(to_array(wire), ReduceOp.SUM, algorithm=algorithm, async_op=True)
            parts.append((wire, flat, flat.dtype, work))
    return Averaging(parts, contribute)
