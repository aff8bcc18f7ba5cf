"""Averaging parameters across a group (torch's ``model_averaging.utils``), Join-aware and metered.

Parameters are divided by the number of contributing ranks first (as torch: an fp16 sum over
many ranks could overflow), then summed: large ones in their own memory, the small ones of a
dtype together in one flat copy that is copied back in place (torch copies everything into one
flat buffer and rebinds ``p.data`` to it, which silently detaches parameters from anything that
kept their storage).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, List, Optional, Sequence

import torch

from autograd_bridge.tensors import to_array
from commlib import ReduceOp

from ddp.stats import ByteCounter, MeteredGroup

__all__ = ["average_parameters", "get_params_to_average", "average_parameters_or_parameter_groups",
           "average_tensors", "tensors_to_average"]


def get_params_to_average(params) -> List[torch.Tensor]:
    """The parameters (of a module's ``parameters()`` or an optimizer's ``param_groups``) that
    have a gradient, as torch's: frozen and unused parameters are left alone."""
    found = []
    for item in params:
        if isinstance(item, torch.Tensor):
            if item.grad is not None:
                found.append(item)
        elif isinstance(item, dict):
            found.extend(p for p in item["params"] if p.grad is not None)
        else:
            raise TypeError(f"expected parameters or parameter groups (dicts), got {type(item).__name__}")
    return found


def tensors_to_average(params_or_module, *, average_buffers: bool = False,
                       module: Optional[torch.nn.Module] = None, who: str = "averager") -> List[torch.Tensor]:
    """Parameters with gradients of ``params_or_module`` (parameters, parameter groups or a
    module), then, with ``average_buffers``, the floating-point buffers of the module (given here
    or as ``module``): BatchNorm's running statistics drift apart in local steps too."""
    if isinstance(params_or_module, torch.nn.Module):
        module = params_or_module if module is None else module
        params_or_module = params_or_module.parameters()
    tensors = get_params_to_average(params_or_module)
    if average_buffers:
        if module is None:
            raise ValueError(f"{who}: average_buffers=True needs the module: pass module= when creating the "
                             f"averager, or the module itself to average_parameters()")
        tensors += [b for b in module.buffers() if b.is_floating_point()]
    return tensors


def _by_dtype(tensors: Sequence[torch.Tensor]) -> "OrderedDict[tuple, List[torch.Tensor]]":
    groups: "OrderedDict[tuple, List[torch.Tensor]]" = OrderedDict()
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return groups


# Tensors at least this big are averaged in their own memory, one allreduce each: no copy into
# and out of a flat buffer (two passes over the model, ~60 ms per 100 MB here, and as much memory).
# Smaller ones share one flat buffer: one collective's latency for all of them.
IN_PLACE_BYTES = 1 << 20


@torch.no_grad()
def average_tensors(tensors: Sequence[torch.Tensor], group, *, contributors: Optional[int] = None,
                    contribute: bool = True, counter: Optional[ByteCounter] = None, algorithm: str = "auto") -> None:
    """Replace each tensor by its average over the ranks of ``group`` that ``contribute``.

    ``contributors``: how many ranks contribute (default all); a rank with ``contribute=False``
    (a joined rank under :class:`ddp.Join`) sends zeros of the same sizes and keeps its tensors.
    Every rank must pass tensors of the same sizes and dtypes in the same order; ``algorithm``
    is the allreduce's.
    """
    if group is None or not tensors:
        return
    divisor = group.size if contributors is None else contributors
    sender = MeteredGroup(group, counter) if counter is not None else group
    for (dtype, device), members in _by_dtype(tensors).items():
        small = []
        for tensor in members:
            if tensor.numel() * tensor.element_size() < IN_PLACE_BYTES or not tensor.is_contiguous():
                small.append(tensor)
            elif contribute:
                tensor.div_(divisor)
                sender.allreduce(to_array(tensor.detach()), ReduceOp.SUM, algorithm=algorithm)
            else:
                sender.allreduce(to_array(torch.zeros_like(tensor)), ReduceOp.SUM, algorithm=algorithm)
        if not small:
            continue
        if contribute:
            flat = torch.cat([t.detach().reshape(-1) for t in small])
            flat.div_(divisor)
        else:
            flat = torch.zeros(sum(t.numel() for t in small), dtype=dtype, device=device)
        sender.allreduce(to_array(flat), ReduceOp.SUM, algorithm=algorithm)
        if contribute:
            offset = 0
            for tensor in small:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def average_parameters(params: Iterable[torch.Tensor], process_group=None) -> None:
    """Average ``params`` (all of them) over ``process_group`` (default: commlib's world), in place."""
    if process_group is None:
        import commlib

        process_group = commlib.world()
    average_tensors(list(params), process_group)


def average_parameters_or_parameter_groups(params, process_group=None) -> None:
    """Average the parameters with gradients of a model or of an optimizer's parameter groups."""
    average_parameters(get_params_to_average(params), process_group)
