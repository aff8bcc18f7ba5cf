"""What a replay of a fault-tolerant run does to the members' contributions, as their managers do
it: each scaled by its share's weight, then summed with the ring allreduce the replicas run (its
threads over the in-process transport run the same schedule as the sockets), then divided. Torch-free,
for the replays of :mod:`tests.support.ft_training` and :mod:`tests.support.ft_sharded`."""

from __future__ import annotations

import functools
from typing import List

import numpy as np

from commlib.algorithms.allreduce.ring import allreduce_ring
from commlib.ft import finish_average
from commlib.ft.sampling import share_weight
from commlib.ops import ReduceOp
from commlib.transports.inprocess import InProcessWorld

__all__ = ["weighted", "ring_mean"]


def weighted(flat: np.ndarray, share: int, global_batch: int, members: int) -> np.ndarray:
    """A member's contribution as its manager scales it (``Manager.allreduce_average``)."""
    out = flat.copy()
    weight = share_weight(share, global_batch, members)
    if weight != 1.0:
        np.multiply(out, out.dtype.type(weight), out=out)
    return out


def ring_mean(flats: List[np.ndarray]) -> np.ndarray:
    """The members' contributions summed with the ring the replicas run, then divided."""
    if len(flats) > 1:
        InProcessWorld(len(flats), timeout=60).run(functools.partial(_ring_sum, flats))
    finish_average(flats[0], len(flats))
    return flats[0]


def _ring_sum(buffers: List[np.ndarray], transport) -> None:
    allreduce_ring(transport, buffers[transport.rank], ReduceOp.SUM)
