"""Construction-time agreement: every rank has the same parameters, then rank 0's values everywhere.

The check must fail, not hang, when models differ: each step exchanges a fixed-size summary
whose size every rank can compute before it knows the others' models. First one number (the
count); only when all counts agree, a table of one fixed-size row per parameter (requires_grad,
dtype, device type, ndim, dims). Every rank compares the same gathered data, so every rank
raises, and the message names the first rank that differs from rank 0 and the parameter.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Sequence, Tuple

import numpy as np
import torch

from autograd_bridge.tensors import to_array

__all__ = ["verify_same_parameters", "broadcast_tensors", "MAX_DIMS"]

MAX_DIMS = 8
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
_DEVICE_TYPES = ["cpu", "cuda"]
_ROW = 4 + MAX_DIMS  # requires_grad, dtype, device type, ndim, dims...


def _row(param: torch.Tensor) -> np.ndarray:
    if param.dim() > MAX_DIMS:
        raise ValueError(f"DDP: parameters with more than {MAX_DIMS} dimensions are not supported "
                         f"(got shape {tuple(param.shape)})")
    row = np.full(_ROW, -1, dtype=np.int64)
    row[0] = int(param.requires_grad)
    row[1] = _DTYPES.index(param.dtype) if param.dtype in _DTYPES else 99
    row[2] = _DEVICE_TYPES.index(param.device.type) if param.device.type in _DEVICE_TYPES else 99
    row[3] = param.dim()
    row[4:4 + param.dim()] = param.shape
    return row


def _describe(row: np.ndarray) -> str:
    dtype = _DTYPES[row[1]] if row[1] < len(_DTYPES) else "other dtype"
    device = _DEVICE_TYPES[row[2]] if row[2] < len(_DEVICE_TYPES) else "other device"
    shape = tuple(int(d) for d in row[4:4 + row[3]])
    grad = "" if row[0] else ", requires_grad=False"
    return f"shape {shape}, {dtype} on {device}{grad}"


def verify_same_parameters(group, named_params: Sequence[Tuple[str, torch.Tensor]]) -> None:
    rank, size = group.rank, group.size
    if size == 1:
        return
    counts = np.zeros(size, dtype=np.int64)
    group.allgather(counts, np.array([len(named_params)], dtype=np.int64))
    if (counts != counts[0]).any():
        other = int(np.flatnonzero(counts != counts[0])[0])
        raise RuntimeError(
            f"DDP (rank {rank}): ranks have different models: rank 0 has {counts[0]} parameters, "
            f"rank {other} has {counts[other]} (this rank has {len(named_params)}); every rank "
            f"must construct DDP around the same model. Counts per rank: {counts.tolist()}")
    if not named_params:
        return
    local = np.stack([_row(p) for _, p in named_params])
    table = np.zeros((size,) + local.shape, dtype=np.int64)
    group.allgather(table, local)
    for other in range(1, size):
        differing = np.flatnonzero((table[other] != table[0]).any(axis=1))
        if differing.size:
            index = int(differing[0])
            name = named_params[index][0]
            raise RuntimeError(
                f"DDP (rank {rank}): ranks have different models: parameter #{index} ({name!r} on "
                f"this rank) has {_describe(table[0][index])} on rank 0 but "
                f"{_describe(table[other][index])} on rank {other}"
                + (f" ({differing.size} parameters differ)" if differing.size > 1 else ""))


def broadcast_tensors(group, tensors: List[torch.Tensor], root: int = 0) -> None:
    """Overwrite ``tensors`` with ``root``'s values, one broadcast per (dtype, device) group.

    Broadcast moves bytes, so each group travels as a flat uint8 view whatever its dtype.
    """
    if group.size == 1 or not tensors:
        return
    groups: "OrderedDict[tuple, List[torch.Tensor]]" = OrderedDict()
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with torch.no_grad():
        for members in groups.values():
            if len(members) == 1 and members[0].is_contiguous():
                flat = members[0].detach().reshape(-1)
                group.broadcast(to_array(flat.view(torch.uint8)), root)
                continue
            flat = torch.cat([t.detach().reshape(-1) for t in members])
            group.broadcast(to_array(flat.view(torch.uint8)), root)
            offset = 0
            for tensor in members:
                count = tensor.numel()
                tensor.copy_(flat[offset:offset + count].view_as(tensor))
                offset += count
