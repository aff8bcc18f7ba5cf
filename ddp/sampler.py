"""``DistributedSampler``: each rank reads its own shard of a data set, a new shuffle each epoch.

The semantics are torch's ``torch.utils.data.DistributedSampler``, index for index: the
permutation of epoch ``e`` comes from ``torch.randperm`` seeded with ``seed + e`` (so a script
moving between the two samplers sees the same data order), then the list is padded by wrapping
around (``drop_last=False``) or truncated (``drop_last=True``) to a multiple of the world size,
and rank ``r`` takes every ``world``-th index starting at ``r``. Every rank therefore gets the
same number of samples, which keeps the ranks' step counts equal: a rank with one step more
than the others would wait forever in its extra allreduce.

The world size and rank come from a commlib process group (default: the world group), not from
``torch.distributed``, so the sampler works with our DDP without a torch process group.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import numpy as np

__all__ = ["DistributedSampler"]


class DistributedSampler:
    """Indices of this rank's shard; call :meth:`set_epoch` before each epoch to reshuffle.

    ``dataset`` is anything with ``len()`` or an int (the number of samples). Usable as the
    ``sampler=`` of a ``torch.utils.data.DataLoader`` or iterated directly.
    """

    def __init__(self, dataset, num_replicas: Optional[int] = None, rank: Optional[int] = None, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, process_group=None):
        length = dataset if isinstance(dataset, (int, np.integer)) else len(dataset)
        if isinstance(length, bool) or int(length) < 0:
            raise ValueError(f"DistributedSampler: expected a data set or a length >= 0, got {dataset!r}")
        if num_replicas is None or rank is None:
            if process_group is None:
                import commlib

                process_group = commlib.world()
            num_replicas = process_group.size if num_replicas is None else num_replicas
            rank = process_group.rank if rank is None else rank
        if int(num_replicas) < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= int(rank) < int(num_replicas):
            raise ValueError(f"DistributedSampler: rank {rank} is not in [0, {int(num_replicas) - 1}]")
        self.dataset = dataset
        self.length = int(length)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        if self.drop_last and self.length % self.num_replicas:
            # The largest multiple of the world size below the length (never negative).
            self.num_samples = max(0, math.ceil((self.length - self.num_replicas) / self.num_replicas))
        else:
            self.num_samples = math.ceil(self.length / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def global_order(self) -> np.ndarray:
        """All ranks' indices for this epoch, padded or truncated to ``total_size`` (int64)."""
        if self.shuffle:
            import torch

            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).numpy()
        else:
            order = np.arange(self.length, dtype=np.int64)
        if self.drop_last or self.total_size <= self.length:
            return order[: self.total_size]
        # Pad by repeating the order from its start, as many times as needed (tiny data sets
        # with more ranks than samples repeat it more than once).
        repeats = math.ceil(self.total_size / max(self.length, 1))
        return np.tile(order, repeats)[: self.total_size]

    def indices(self) -> np.ndarray:
        """This rank's indices for the current epoch."""
        return self.global_order()[self.rank: self.total_size: self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"DistributedSampler(length={self.length}, rank={self.rank}/{self.num_replicas}, "
                f"shuffle={self.shuffle}, seed={self.seed}, drop_last={self.drop_last}, "
                f"epoch={self.epoch})")
