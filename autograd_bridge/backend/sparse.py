"""allreduce of a sparse COO tensor, as gloo does it: gather every rank's entries, then add.

Each rank coalesces its tensor (duplicates summed), then the ranks exchange (1) a small
metadata row each (nnz, sparse and dense dims, sizes), checked to agree, so a mismatch raises
the same error on every rank before any entry moves, and (2) their indices and values, packed
as bytes into one block per rank padded to the largest nnz, in one commlib allgather. The sum
is then built as gloo builds it (rank 0's entries, plus each next rank's as a sparse add, then
one coalesce), so the result has the same entries and the same bits as gloo's. Only SUM: the
other ops have no meaning for the implicit zeros. The tensor is updated in place (``copy_``),
and the future's value is ``[tensor]``, as DDP's sparse gradients need.
"""

from __future__ import annotations

from typing import List

import numpy as np
import torch

import commlib
from commlib import InvalidUsageError

from autograd_bridge.backend.reduce_ops import SUM_VALUE, op_name, op_value_of, plan_reduction
from autograd_bridge.tensors import to_array

__all__ = ["SparseAllreduce"]

_MAX_DIMS = 16
_META = 4 + _MAX_DIMS  # nnz, sparse_dim, dense_dim, ndim, sizes
_ALIGN = 16  # every block and the values inside it start at a multiple of the widest element


class SparseAllreduce:
    """One sparse allreduce: ``issue(async_op)`` runs the data allgather, ``finish()`` adds up."""

    def __init__(self, group: "commlib.ProcessGroup", tensor: torch.Tensor, op, collective: str = "all_reduce"):
        value = SUM_VALUE if op is None else op_value_of(op)
        if value != SUM_VALUE:
            raise InvalidUsageError(f"commlib backend: {collective} with {op_name(value)} on a sparse "
                                    f"{tensor.dtype} tensor on {tensor.device} is not supported: the entries "
                                    f"a rank does not hold are zeros; expected SUM (as gloo)")
        if tensor.dim() > _MAX_DIMS:
            raise InvalidUsageError(f"commlib backend: {collective}: a sparse tensor of {tensor.dim()} dims; "
                                    f"expected at most {_MAX_DIMS}")
        plan_reduction(collective, None, [tensor._values()])
        self.group, self.tensor, self.collective = group, tensor, collective
        local = tensor.coalesce()
        self.shape = tuple(local.shape)
        self.sparse_dim, self.dense_shape = local.sparse_dim(), tuple(local.values().shape[1:])
        self.everyone = self._exchange_metadata(local)
        self.nnz = [int(n) for n in self.everyone[:, 0]]
        width = max(self.nnz)
        self.index_bytes = _aligned(self.sparse_dim * width * 8)
        self.row_bytes = int(np.prod(self.dense_shape, dtype=np.int64)) * local.values().element_size()
        self.block = max(_ALIGN, _aligned(self.index_bytes + width * self.row_bytes))  # views of empty rows misalign
        mine = torch.zeros(self.block, dtype=torch.uint8)
        count = self.nnz[group.rank]
        self._indices(mine, count).copy_(local.indices())
        self._values(mine, count).copy_(local.values())
        self.mine = mine
        self.gathered = torch.empty(group.size * self.block, dtype=torch.uint8)

    def _exchange_metadata(self, local: torch.Tensor) -> np.ndarray:
        mine = np.zeros(_META, np.int64)
        mine[:4] = (local._nnz(), local.sparse_dim(), local.dense_dim(), local.dim())
        mine[4:4 + local.dim()] = local.shape
        everyone = np.empty((self.group.size, _META), np.int64)
        self.group.allgather(everyone, mine)
        if (everyone[:, 1:] != mine[1:]).any():
            shown = "; ".join(f"rank {r}: sizes {tuple(row[4:4 + row[3]].tolist())} with {row[1]} sparse dims"
                              for r, row in enumerate(everyone))
            raise InvalidUsageError(f"commlib backend: {self.collective} of sparse tensors: the ranks' shapes "
                                    f"differ ({shown}); expected the same sizes and sparse dims on every rank")
        return everyone

    def _indices(self, block: torch.Tensor, count: int) -> torch.Tensor:
        width = max(self.nnz)
        return block[:self.sparse_dim * width * 8].view(torch.int64).view(self.sparse_dim, width)[:, :count]

    def _values(self, block: torch.Tensor, count: int) -> torch.Tensor:
        width = max(self.nnz)
        dtype = self.tensor.dtype
        raw = block[self.index_bytes:self.index_bytes + width * self.row_bytes]
        return raw.view(dtype).view((width,) + self.dense_shape)[:count]

    def issue(self, async_op: bool):
        return self.group.allgather(to_array(self.gathered), to_array(self.mine), async_op=async_op)

    def finish(self) -> None:
        blocks = self.gathered.view(self.group.size, self.block)
        parts: List[torch.Tensor] = []
        for r, n in enumerate(self.nnz):
            indices = self._indices(blocks[r], n)
            self._check_in_bounds(indices, r)
            parts.append(torch.sparse_coo_tensor(indices, self._values(blocks[r], n), self.shape,
                                                 dtype=self.tensor.dtype))
        total = parts[0]
        for part in parts[1:]:
            total += part
        self.tensor.copy_(total.coalesce())


    def _check_in_bounds(self, indices: torch.Tensor, rank: int) -> None:
        """Entries from a peer are indices into this rank's memory (torch builds the sum without
        checking them: an index out of bounds is a write out of bounds); a peer's bytes that are
        not what it sent end as an error here, never a crash."""
        if indices.shape[1] == 0:
            return
        low, high = indices.min(dim=1).values, indices.max(dim=1).values
        limits = torch.tensor(self.shape[:self.sparse_dim], dtype=torch.int64)
        if bool((low < 0).any()) or bool((high >= limits).any()):
            raise commlib.CommError(
                f"commlib backend: {self.collective} of a sparse tensor of sizes {self.shape} on rank "
                f"{self.group.rank}/{self.group.size}: rank {rank}'s {indices.shape[1]} entries arrived with "
                f"indices from {low.tolist()} to {high.tolist()}, outside the sizes; expected what that "
                f"rank coalesced (its bytes were altered on the way)")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN

