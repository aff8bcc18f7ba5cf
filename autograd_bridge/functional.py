"""Differentiable collectives: out-of-place, and their backward is the adjoint collective.

    from autograd_bridge import functional as F
    y = F.all_reduce(x)            # y = sum over ranks of x, on every rank

Think of the P ranks' inputs as one long vector ``X = (x_0, ..., x_{P-1})`` and of a collective as
a linear map ``Y = A X``; the backward of a linear map is its transpose, ``dX = A^T dY``, and the
transpose of each collective is another collective:

=====================  ==========================================  ==========================
forward                y_r                                         backward (dx_r)
=====================  ==========================================  ==========================
all_reduce (SUM)       sum_s x_s                                   all_reduce (SUM) of dy
all_reduce (AVG)       mean_s x_s                                  all_reduce (AVG) of dy
all_gather             cat_s x_s (dim 0)                           reduce_scatter (SUM) of dy
reduce_scatter (SUM)   chunk r of sum_s x_s (dim 0)                all_gather of dy
broadcast (src)        x_src                                       reduce to src: sum on src, 0 elsewhere
reduce (dst)           sum_s x_s on dst, zeros elsewhere           broadcast of dy from dst
all_to_all             cat_s (rows of x_s for r) (dim 0)           all_to_all of dy, splits
                                                                   swapped
=====================  ==========================================  ==========================

Each backward is written with these same functions, so double backward works too. MIN, MAX
and PRODUCT are not linear and are refused (use ``torch.distributed`` for them).

``group``: a ``commlib.ProcessGroup``, a torch process group of the "commlib" backend, or None:
the default torch group if it is a "commlib" one, else ``commlib.init()``'s world group.
CUDA tensors go to commlib's GPU path, ordered after torch's current stream (not run here: no
GPU in this environment). Every rank must call the same collectives in the same order, backward
included: autograd runs the backward of a graph in a deterministic order, so the same graph on
every rank is enough.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

import commlib
from commlib import InvalidUsageError, ReduceOp

from autograd_bridge.tensors import to_array

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"]

_LINEAR_OPS = (ReduceOp.SUM, ReduceOp.AVG)


def _group(group) -> "commlib.ProcessGroup":
    if isinstance(group, commlib.ProcessGroup):
        return group
    from autograd_bridge.backend.process_group import CommlibProcessGroup

    if isinstance(group, CommlibProcessGroup):
        return group.commlib_group
    if group is None:
        if dist.is_initialized():
            default = dist.distributed_c10d._get_default_group()
            if isinstance(default, CommlibProcessGroup):
                return default.commlib_group
        return commlib.init()
    raise InvalidUsageError(
        f"group: expected a commlib.ProcessGroup, a torch group of the 'commlib' backend, or None; "
        f"got {group!r}"
    )


def _linear_op(op, collective: str) -> ReduceOp:
    op = ReduceOp.coerce(op)
    if op not in _LINEAR_OPS:
        raise InvalidUsageError(
            f"functional.{collective}: op {op.name} has no gradient here; expected SUM or AVG"
        )
    return op


def _dim0_chunks(x: torch.Tensor, size: int, collective: str) -> None:
    if x.dim() == 0 or x.shape[0] % size:
        raise InvalidUsageError(
            f"functional.{collective}: input of shape {tuple(x.shape)} cannot be split in {size} "
            f"equal chunks along dim 0; expected shape[0] divisible by the group size {size}"
        )


def _on_stream_of(x: torch.Tensor):
    """CUDA: run the collective ordered after torch's current stream (see cuda_streams.py); CPU: nothing."""
    if not x.is_cuda:
        return contextlib.nullcontext()
    from autograd_bridge.cuda_streams import on_torch_stream

    return on_torch_stream(x.device)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy that the collective may overwrite (the collectives are out-of-place)."""
    return x.detach().clone(memory_format=torch.contiguous_format)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, group):
        ctx.op, ctx.group = op, group
        out = _fresh(x)
        with _on_stream_of(out):
            group.allreduce(to_array(out), op)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllReduce.apply(grad, ctx.op, ctx.group), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        inp = x.detach().contiguous()
        out = torch.empty((group.size * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype,
                          device=inp.device)
        with _on_stream_of(out):
            group.allgather(to_array(out), to_array(inp))
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, ReduceOp.SUM, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, op, group):
        ctx.op, ctx.group = op, group
        inp = x.detach().contiguous()
        out = torch.empty((inp.shape[0] // group.size,) + tuple(inp.shape[1:]), dtype=inp.dtype,
                          device=inp.device)
        with _on_stream_of(out):
            group.reduce_scatter(to_array(out), to_array(inp), op)
        return out

    @staticmethod
    def backward(ctx, grad):
        gathered = _AllGather.apply(grad, ctx.group)
        if ctx.op is ReduceOp.AVG:
            gathered = gathered / ctx.group.size
        return gathered, None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, group):
        ctx.src, ctx.group = src, group
        out = _fresh(x)
        with _on_stream_of(out):
            group.broadcast(to_array(out), src)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _Reduce.apply(grad, ctx.src, ctx.group), None, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dst, group):
        ctx.dst, ctx.group = dst, group
        out = _fresh(x)
        with _on_stream_of(out):
            group.reduce(to_array(out), dst, ReduceOp.SUM)
        if group.rank != dst:
            out.zero_()  # what MPI leaves in a non-root buffer is unspecified; the map says 0
        return out

    @staticmethod
    def backward(ctx, grad):
        return _Broadcast.apply(grad, ctx.dst, ctx.group), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        inp = x.detach().contiguous()
        row = math.prod(inp.shape[1:])
        out = torch.empty((sum(out_splits),) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
        with _on_stream_of(out):
            group.alltoallv(to_array(out), to_array(inp), [rows * row for rows in out_splits],
                            [rows * row for rows in in_splits])
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _check_tensor(x, collective: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"functional.{collective}: expected a torch.Tensor, got {type(x).__name__}")


def all_reduce(x: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """Sum (or mean, ``op="avg"``) of ``x`` over the ranks, on every rank. Backward: the same."""
    _check_tensor(x, "all_reduce")
    return _AllReduce.apply(x, _linear_op(op, "all_reduce"), _group(group))


def all_gather(x: torch.Tensor, group=None) -> torch.Tensor:
    """The ranks' ``x`` concatenated along dim 0 in rank order. Backward: reduce_scatter (sum)."""
    _check_tensor(x, "all_gather")
    if x.dim() == 0:
        raise InvalidUsageError("functional.all_gather: expected a tensor with at least one dimension")
    return _AllGather.apply(x, _group(group))


def reduce_scatter(x: torch.Tensor, op=ReduceOp.SUM, group=None) -> torch.Tensor:
    """Chunk ``rank`` (along dim 0) of the sum over ranks of ``x``. Backward: all_gather."""
    _check_tensor(x, "reduce_scatter")
    op = _linear_op(op, "reduce_scatter")
    group = _group(group)
    _dim0_chunks(x, group.size, "reduce_scatter")
    return _ReduceScatter.apply(x, op, group)


def broadcast(x: torch.Tensor, src: int = 0, group=None) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank. Backward: the sum of the gradients, on ``src`` only."""
    _check_tensor(x, "broadcast")
    group = _group(group)
    if not 0 <= src < group.size:
        raise InvalidUsageError(f"functional.broadcast: src {src} out of range; expected 0 <= src < {group.size}")
    return _Broadcast.apply(x, src, group)


def reduce(x: torch.Tensor, dst: int = 0, group=None) -> torch.Tensor:
    """The sum over ranks of ``x`` on ``dst``, zeros elsewhere. Backward: broadcast from ``dst``."""
    _check_tensor(x, "reduce")
    group = _group(group)
    if not 0 <= dst < group.size:
        raise InvalidUsageError(f"functional.reduce: dst {dst} out of range; expected 0 <= dst < {group.size}")
    return _Reduce.apply(x, dst, group)


def all_to_all(x: torch.Tensor, output_split_sizes=None, input_split_sizes=None, group=None) -> torch.Tensor:
    """Rows of ``x`` to every rank: ``input_split_sizes[j]`` rows (dim 0) go to rank ``j``, and
    ``output_split_sizes[i]`` rows arrive from rank ``i``, concatenated in rank order (None:
    equal splits). Backward: all_to_all of the gradient with the two splits swapped."""
    _check_tensor(x, "all_to_all")
    group = _group(group)
    if x.dim() == 0:
        raise InvalidUsageError("functional.all_to_all: expected a tensor with at least one dimension")
    splits = []
    for name, given in (("output_split_sizes", output_split_sizes), ("input_split_sizes", input_split_sizes)):
        if given is None:
            _dim0_chunks(x, group.size, "all_to_all")
            given = [x.shape[0] // group.size] * group.size
        if len(given) != group.size or any(int(rows) < 0 for rows in given):
            raise InvalidUsageError(f"functional.all_to_all: {name} {list(given)}: expected {group.size} "
                                    f"row counts >= 0, one per rank")
        splits.append(tuple(int(rows) for rows in given))
    if sum(splits[1]) != x.shape[0]:
        raise InvalidUsageError(f"functional.all_to_all: input_split_sizes add up to {sum(splits[1])} rows; "
                                f"expected x.shape[0] = {x.shape[0]}")
    return _AllToAll.apply(x, splits[0], splits[1], group)
