"""bfloat16 on the backend, against gloo bit for bit: moved as bytes by every collective that does
not reduce (send/recv, broadcast, all_gather, all_to_all, gather, scatter), reduced by those
that do (all_reduce with each op, reduce, reduce_scatter). The P=2 job runs with ml_dtypes
blocked (``--without-ml-dtypes``): a torch user needs no optional package.

At P=2 the values are random (one rounding per reduction, which gloo and the backend must
round alike); above, small multiples of 1/4 (every sum, mean and product of them exact in
bfloat16), since a longer sum's rounding depends on its order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.mpi.torch_stack.common import same_bits

RED = dist.ReduceOp


def _values(seed, n, exact):
    g = torch.Generator().manual_seed(seed)
    if exact:
        return (torch.randint(-8, 9, (n,), generator=g) / 4).to(torch.bfloat16)
    return torch.randn(n, generator=g).to(torch.bfloat16)


def _factors(seed, n):
    """Products of these stay exact: +-1/2, +-1, +-2."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([-2.0, -1.0, -0.5, 0.5, 1.0, 2.0])
    return choices[torch.randint(0, 6, (n,), generator=g)].to(torch.bfloat16)


def check_bf16(checker):
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    exact = size > 2
    n = 37

    def on_both(what, fn):
        ours, theirs = fn(None), fn(gloo)
        same_bits(checker, ours, theirs, f"bfloat16 {what}")

    for op in (RED.SUM, RED.AVG, RED.MIN, RED.MAX, RED.PRODUCT):
        def all_reduce(group, op=op):
            t = _factors(rank, n) if op == RED.PRODUCT else _values(rank, n, exact)
            dist.all_reduce(t, op=op, group=group)
            return t

        on_both(f"all_reduce {op}", all_reduce)

    def reduce(group):
        t = _values(rank, n, exact)
        dist.reduce(t, dst=0, group=group)
        return t if rank == 0 else torch.zeros(0, dtype=torch.bfloat16)

    on_both("reduce", reduce)

    def reduce_scatter(group):
        out = torch.empty(n, dtype=torch.bfloat16)
        dist.reduce_scatter_tensor(out, _values(rank, n * size, exact), group=group)
        return out

    on_both("reduce_scatter_tensor", reduce_scatter)
    _check_moves(on_both, rank, size, n)


def _check_moves(on_both, rank, size, n):
    def broadcast(group):
        t = _values(rank, n, exact=False)
        dist.broadcast(t, src=size - 1, group=group)
        return t

    def all_gather(group):
        out = torch.empty(n * size, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(out, _values(rank, n, exact=False), group=group)
        return out

    def all_to_all(group):
        out = torch.empty(3 * size, dtype=torch.bfloat16)
        dist.all_to_all_single(out, _values(rank, 3 * size, exact=False), group=group)
        return out

    def gather(group):
        parts = [torch.empty(n, dtype=torch.bfloat16) for _ in range(size)] if rank == 0 else None
        dist.gather(_values(rank, n, exact=False), parts, dst=0, group=group)
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.bfloat16)

    def scatter(group):
        out = torch.empty(n, dtype=torch.bfloat16)
        parts = [_values(100 + r, n, exact=False) for r in range(size)] if rank == 0 else None
        dist.scatter(out, parts, src=0, group=group)
        return out

    def ring(group):
        """send to the next rank, receive from the previous (even ranks send first)."""
        out = torch.empty(n, dtype=torch.bfloat16)
        if size == 1:
            return out.zero_()
        mine, after, before = _values(rank, n, exact=False), (rank + 1) % size, (rank - 1) % size
        if rank % 2 == 0:
            dist.send(mine, after, group=group)
            dist.recv(out, before, group=group)
        else:
            dist.recv(out, before, group=group)
            dist.send(mine, after, group=group)
        return out

    for what, fn in (("broadcast", broadcast), ("all_gather_into_tensor", all_gather),
                     ("all_to_all_single", all_to_all), ("gather", gather), ("scatter", scatter),
                     ("send/recv", ring)):
        on_both(what, fn)
