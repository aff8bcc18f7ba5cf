"""Sparse COO allreduce on the backend (as gloo's: gather every rank's entries, then add), and
torch's DDP with a sparse embedding gradient, each against gloo bit for bit.

Cases: duplicate indices (an uncoalesced input), two sparse dims, a dense trailing dim (an
embedding gradient), a rank holding no entry, nobody holding any, integer and bfloat16 values,
sync (and async for some); the input tensor itself holds the sum afterwards (as on gloo). Ranks whose
sizes disagree get the same error on every rank; a peer's entries whose indices arrive out of
bounds end in a CommError that names that peer, not a write out of bounds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from autograd_bridge.backend.sparse import SparseAllreduce
from commlib import CommError, InvalidUsageError
from tests.mpi.torch_stack.common import GridLinear, same_bits


def _sparse(rank, shape, sparse_dim, nnz, dtype, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    indices = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sparse_dim)])
    values = torch.randn((nnz,) + tuple(shape[sparse_dim:]), generator=g)
    if not dtype.is_floating_point:
        values = (values * 10).round()
    return torch.sparse_coo_tensor(indices, values.to(dtype), shape)


CASES = {  # name -> (shape, sparse dims, nnz of rank r, dtype)
    "duplicates 1-D": ((50,), 1, lambda r: 30 + 5 * r, torch.float32),
    "two sparse dims": ((9, 7), 2, lambda r: 12 - r, torch.float64),
    "embedding rows": ((100, 8), 1, lambda r: 20 + r, torch.float32),
    "rank 0 holds nothing": ((20, 3), 1, lambda r: 0 if r == 0 else 6, torch.float32),
    "nobody holds anything": ((20, 3), 1, lambda r: 0, torch.float32),
    "int64 values": ((30, 2), 1, lambda r: 10, torch.int64),
    "bfloat16 values": ((40, 4), 1, lambda r: 15, torch.bfloat16),
}


def check_sparse(checker):
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    for seed, (name, (shape, sparse_dim, nnz, dtype)) in enumerate(CASES.items()):
        for async_op in (False, True) if seed % 3 == 0 else (False,):
            results = {}
            for backend, group in (("commlib", None), ("gloo", gloo)):
                tensor = _sparse(rank, shape, sparse_dim, nnz(rank), dtype, seed)
                work = dist.all_reduce(tensor, group=group, async_op=async_op)
                if async_op:
                    value = work.get_future().wait()[0]
                    checker.check(value is tensor, f"sparse {name}: the future's value is not the input tensor")
                results[backend] = tensor
            ours, theirs = results["commlib"], results["gloo"]
            what = f"sparse all_reduce {name} async_op={async_op}"
            checker.check(ours.is_coalesced(), f"{what}: the result is not coalesced")
            same_bits(checker, ours._indices(), theirs._indices(), f"{what}: indices")
            same_bits(checker, ours._values(), theirs._values(), f"{what}: values")
            whole = sum((_sparse(r, shape, sparse_dim, nnz(r), dtype, seed).to_dense().double() for r in range(size)))
            checker.close(ours.to_dense().double().numpy(), whole.numpy(), f"{what}: dense sum",
                          rtol=1e-2 if dtype is torch.bfloat16 else 1e-6, atol=1e-2)
    _check_mismatch(checker, rank)
    _check_altered_indices(checker, rank, dist.get_world_size())
    _check_ddp_embedding(checker, rank, gloo)


def _check_mismatch(checker, rank):
    tensor = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (10 + rank % 2,))
    error = checker.raises(InvalidUsageError, lambda: dist.all_reduce(tensor), "sparse all_reduce of differing sizes")
    if error is not None and dist.get_world_size() > 1:
        checker.check("(10,)" in str(error) and "(11,)" in str(error), f"the error names both sizes: {error}")
    after = torch.ones(2)
    dist.all_reduce(after)
    checker.equal(after.numpy(), torch.full((2,), float(dist.get_world_size())).numpy(),
                  "all_reduce after the refused sparse one")


def _check_altered_indices(checker, rank, size):
    """The allgather's bytes of the next rank's first index altered here, after they arrived and
    before the sum is built (what a fault on the way would leave): every rank names that rank."""
    def mine():
        return torch.sparse_coo_tensor(torch.tensor([[rank, rank + 10, rank + 20, rank + 30]]), torch.ones(4), (50,))

    tensor = mine()
    call = SparseAllreduce(dist.group.WORLD.commlib_group, tensor, None)
    call.issue(False)
    peer = (rank + 1) % size
    call.gathered.view(size, call.block)[peer, :8].view(torch.int64).fill_(50 + peer)
    error = checker.raises(CommError, call.finish, "sparse all_reduce with a peer's indices altered")
    if error is not None:
        checker.check(f"rank {peer}'s 4 entries" in str(error) and "(50,)" in str(error),
                      f"the error names the peer and the sizes: {error}")
    checker.equal(tensor.to_dense().numpy(), mine().to_dense().numpy(), "the refused sum left the input as it was")


class _Bag(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(1000, 16, sparse=True)
        self.head = GridLinear(16, 1)  # dense gradients summed in any order: see common

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(dim=1))


def _check_ddp_embedding(checker, rank, gloo):
    """DDP with ``nn.Embedding(sparse=True)``: its gradient is allreduced as a sparse tensor."""
    trained = {}
    for backend, group in (("commlib", None), ("gloo", gloo)):
        model = DDP(_Bag(), process_group=group)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        data = torch.Generator().manual_seed(rank)
        for _ in range(3):
            tokens = torch.randint(0, 1000, (8, 5), generator=data)
            model(tokens).pow(2).mean().backward()
            checker.check(model.module.embedding.weight.grad.is_sparse, f"DDP on {backend}: the gradient is not sparse")
            optimizer.step()
            optimizer.zero_grad()
        trained[backend] = [p.detach().clone() for p in model.parameters()]
    for index, (ours, theirs) in enumerate(zip(trained["commlib"], trained["gloo"])):
        same_bits(checker, ours, theirs, f"DDP with a sparse embedding: parameter {index}")
    checker.check(not torch.equal(trained["commlib"][0], _Bag().embedding.weight.detach()),
                  "DDP with a sparse embedding: the embedding did not train")
