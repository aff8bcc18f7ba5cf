"""Reductions torch asks for that gloo serves differently or not at all.

* PREMUL_SUM (FSDP2's reduce-scatter with a gradient divide factor; gloo refuses it): each
  rank's input times the factor, summed: bitwise what gloo's SUM gives on inputs scaled by torch,
  for all_reduce, reduce (the ranks other than the root keep their tensor) and reduce_scatter,
  in float32, bfloat16 and complex64.
* allreduce_coalesced (several small tensors packed into one collective), AVG, against gloo.
* bool: SUM is a logical or and PRODUCT a logical and (as NCCL), MIN and MAX too: every byte of
  the result a valid bool. gloo's PRODUCT, MIN and MAX agree; its SUM adds the bytes (a bool
  holding 2), so SUM is held against the logical or instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceOptions, ReduceScatterOptions

from tests.mpi.torch_stack.common import same_bits

RED = dist.ReduceOp


def _opts(kind, op, root=None):
    opts = kind()
    opts.reduceOp = op
    opts.asyncOp = False
    if root is not None:
        opts.rootRank = root
    return opts


def check_reductions(checker):
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    world = dist.group.WORLD
    factor = 0.375
    premul = dist._make_nccl_premul_sum(factor)
    for dtype in (torch.float32, torch.bfloat16, torch.complex64):
        g = torch.Generator().manual_seed(rank)
        drawn = torch.complex64 if dtype.is_complex else torch.float32
        mine = torch.randn(6 * size, generator=g, dtype=drawn).to(dtype)
        if size > 2:  # exact sums of 4 (see common): eighths below 4
            parts = torch.view_as_real(mine) if dtype.is_complex else mine
            parts.copy_((parts.float() * 8).round().clamp(-32, 32) / 8)
        scaled = mine * factor

        ours = mine.clone()
        world.allreduce([ours], _opts(AllreduceOptions, premul)).wait()
        theirs = scaled.clone()
        dist.all_reduce(theirs, group=gloo)
        same_bits(checker, ours, theirs, f"PREMUL_SUM all_reduce {dtype}")

        root = size - 1
        ours = mine.clone()
        world.reduce([ours], _opts(ReduceOptions, premul, root)).wait()
        theirs = scaled.clone()
        dist.reduce(theirs, dst=root, group=gloo)
        if rank != root:
            theirs = mine  # untouched
        same_bits(checker, ours, theirs, f"PREMUL_SUM reduce {dtype} (root {root})")

        out = torch.empty(6, dtype=dtype)
        world.reduce_scatter_single(out, mine, _opts(ReduceScatterOptions, premul)).wait()
        expected = torch.empty(6, dtype=dtype)
        dist.reduce_scatter_tensor(expected, scaled.clone(), group=gloo)
        same_bits(checker, out, expected, f"PREMUL_SUM reduce_scatter {dtype}")
    _check_coalesced(checker, world, gloo, rank)
    for op in (RED.SUM, RED.PRODUCT, RED.MIN, RED.MAX):
        flags = {name: torch.tensor([rank == 0, True, rank == size - 1, False, rank % 2 == 1]) for name in ("c", "g")}
        dist.all_reduce(flags["c"], op=op)
        dist.all_reduce(flags["g"], op=op, group=gloo)
        if op == RED.SUM:
            flags["g"] = torch.tensor([True, True, True, False, size > 1])
        same_bits(checker, flags["c"].view(torch.uint8), flags["g"].view(torch.uint8), f"bool all_reduce {op}")
        checker.check(bool((flags["c"].view(torch.uint8) <= 1).all()), f"bool all_reduce {op}: a byte above 1")


def _check_coalesced(checker, world, gloo, rank):
    from torch._C._distributed_c10d import AllreduceCoalescedOptions

    def tensors():
        g = torch.Generator().manual_seed(50 + rank)
        return [torch.randint(-8, 9, (n,), generator=g).float() for n in (3, 17, 1, 40)]

    opts = AllreduceCoalescedOptions()
    opts.reduceOp = RED.AVG
    ours, theirs = tensors(), tensors()
    world.allreduce_coalesced(ours, opts).wait()
    for t in theirs:
        dist.all_reduce(t, group=gloo)
        t /= dist.get_world_size()
    for index, (a, b) in enumerate(zip(ours, theirs)):
        same_bits(checker, a, b, f"allreduce_coalesced AVG: tensor {index}")
