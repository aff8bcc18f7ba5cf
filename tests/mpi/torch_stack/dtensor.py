"""DTensor on the backend: distribute_tensor, redistribute between Shard/Replicate/Partial (even
and uneven shards, 1-D and 2-D meshes), full_tensor, a matmul and a sum that need collectives,
and tensor parallelism (colwise then rowwise Linear, forward and backward).

Inputs are small integers (exact in float32 in any summation order), so each result must equal
the gloo mesh's bit for bit, and the plain local computation on the whole tensor too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.mpi.torch_stack.common import integers, meshes, same_bits, seq_of

_MOVES = [  # (from, to) placements on a 1-D mesh
    ([Shard(0)], [Replicate()]), ([Shard(1)], [Replicate()]), ([Shard(0)], [Shard(1)]),
    ([Replicate()], [Shard(0)]), ([Shard(1)], [Shard(0)]),
]


def _on_both(checker, both, what, fn, expected=None):
    """``fn(mesh)`` on each mesh; the results (tensors) bitwise equal, and equal to ``expected``."""
    ours, theirs = fn(both["commlib"]), fn(both["gloo"])
    same_bits(checker, ours, theirs, what)
    if expected is not None:
        same_bits(checker, ours, expected, f"{what} vs the local result")


def check_dtensor(checker):
    size = dist.get_world_size()
    flat = meshes((size,))
    before = seq_of(flat["commlib"])
    for shape in ((4 * size, 6), (2 * size + 1, 5)):  # even and uneven shards
        whole = integers(shape, seed=shape[0])
        for start, end in _MOVES:
            def move(mesh, start=start, end=end, whole=whole):
                return distribute_tensor(whole, mesh, start).redistribute(mesh, end).full_tensor()

            _on_both(checker, flat, f"redistribute {start} -> {end} of {shape}", move, whole)
        _on_both(checker, flat, f"distribute_tensor Shard(0) of {shape}: local shard",
                 lambda mesh, whole=whole: distribute_tensor(whole, mesh, [Shard(0)]).to_local().clone())
    _check_partial(checker, flat, size)
    _check_ops(checker, flat)
    checker.check(seq_of(flat["commlib"]) > before, "DTensor ran no collective on the commlib group")
    if size % 2 == 0:
        _check_2d(checker, size)
    _check_tensor_parallel(checker, flat)


def _check_partial(checker, flat, size):
    rank = dist.get_rank()
    contributions = [integers((size * 2, 3), seed=100 + r) for r in range(size)]
    total = sum(contributions[1:], contributions[0])
    for end in ([Replicate()], [Shard(0)]):
        def reduce(mesh, end=end):
            partial = DTensor.from_local(contributions[rank], mesh, [Partial()])
            return partial.redistribute(mesh, end).full_tensor()

        _on_both(checker, flat, f"redistribute Partial -> {end}", reduce, total)


def _check_ops(checker, flat):
    x, w = integers((8, 12), seed=1), integers((12, 6), seed=2)

    def matmul(mesh):
        return (distribute_tensor(x, mesh, [Shard(1)]) @ distribute_tensor(w, mesh, [Shard(0)])).full_tensor()

    _on_both(checker, flat, "matmul Shard(1) @ Shard(0) (a Partial result)", matmul, x @ w)
    _on_both(checker, flat, "sum of a Shard(0) DTensor",
             lambda mesh: distribute_tensor(x, mesh, [Shard(0)]).sum().full_tensor(), x.sum())
    _on_both(checker, flat, "row sums of a Shard(1) DTensor",
             lambda mesh: distribute_tensor(x, mesh, [Shard(1)]).sum(dim=1).full_tensor(), x.sum(dim=1))


def _check_2d(checker, size):
    both = meshes((2, size // 2), ("dp", "tp"))
    whole = integers((4, 2 * size + 2), seed=7)
    for start, end in (([Shard(0), Shard(1)], [Replicate(), Replicate()]),
                       ([Replicate(), Shard(1)], [Shard(0), Replicate()]),
                       ([Shard(1), Shard(0)], [Shard(0), Shard(1)])):
        def move(mesh, start=start, end=end, whole=whole):
            return distribute_tensor(whole, mesh, start).redistribute(mesh, end).full_tensor()

        _on_both(checker, both, f"2-D redistribute {start} -> {end}", move, whole)
    rank = dist.get_rank()

    def partial_rows(mesh):
        local = integers((3, 4), seed=200 + rank)
        return DTensor.from_local(local, mesh, [Partial(), Shard(0)]).redistribute(
            mesh, [Replicate(), Replicate()]).full_tensor()

    _on_both(checker, both, "2-D redistribute (Partial, Shard(0)) -> Replicate", partial_rows)


def _check_tensor_parallel(checker, flat):
    size = dist.get_world_size()
    results = {}
    for name, mesh in flat.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4 * size), torch.nn.ReLU(), torch.nn.Linear(4 * size, 8))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(integers(p.shape, seed=p.numel(), low=-2, high=3))
        model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x = integers((5, 8), seed=3, low=-2, high=3)
        out = model(x)
        out.sum().backward()
        results[name] = [out.detach().clone()] + [p.grad.full_tensor() for p in model.parameters()]
    for index, (ours, theirs) in enumerate(zip(results["commlib"], results["gloo"])):
        same_bits(checker, ours, theirs, "tensor parallel output" if index == 0 else f"tensor parallel grad {index}")
