"""The model of the replica-group tests: a linear regression split by features across a replica's
ranks (tests/ft/replica_group_ranks.py), and its replay without failures.

Local rank ``j`` of ``size`` holds the weights of feature block ``j``: its part of a prediction
is its block's features times its weights; the parts summed over the replica's ranks are the
prediction; its gradient is its block's. Sums are numpy's ``sum`` along an axis (not BLAS, whose
blocking may differ between processes), so the replay, which computes every block in one
process, gets the same bits.
"""

from __future__ import annotations

from typing import List

import numpy as np

from commlib.ft import Ledger
from commlib.ft.sampling import permutation, shares
from tests.support.ft_replay import ring_mean, weighted

__all__ = ["DATASET_SIZE", "BATCH_SIZE", "SEED", "BLOCK", "LEARNING_RATE", "Sharded", "replay"]

DATASET_SIZE, BATCH_SIZE, SEED = 96, 4, 11
BLOCK = 6  # features per rank
LEARNING_RATE = 0.05


def _data(size: int):
    rng = np.random.default_rng(SEED)
    features = rng.standard_normal((DATASET_SIZE, BLOCK * size))
    targets = features @ rng.standard_normal(BLOCK * size) + 0.1 * rng.standard_normal(DATASET_SIZE)
    return features, targets


class Sharded:
    """Local rank ``rank``'s block of the model (and the whole data set: it is small)."""

    def __init__(self, rank: int, size: int):
        features, self.targets = _data(size)
        self.block = np.ascontiguousarray(features[:, rank * BLOCK:(rank + 1) * BLOCK])
        self.weights = np.zeros(BLOCK)

    def partial_prediction(self, indices: np.ndarray) -> np.ndarray:
        return np.sum(self.block[indices] * self.weights, axis=1)

    def gradient(self, indices: np.ndarray, prediction: np.ndarray) -> np.ndarray:
        error = prediction - self.targets[indices]
        return np.sum(self.block[indices] * error[:, None], axis=0) / len(indices)

    def apply(self, gradient: np.ndarray) -> None:
        self.weights -= LEARNING_RATE * gradient


def replay(ledger_json: dict, size: int) -> List[np.ndarray]:
    """Every block's weights after the ledger's committed steps, trained without failures."""
    ledger = Ledger.from_json(ledger_json)
    blocks = [Sharded(rank, size) for rank in range(size)]
    for record in ledger.steps:
        members = len(record.members)
        order = permutation(ledger.dataset_size, ledger.seed, record.data_epoch)
        contributions: List[List[np.ndarray]] = [[] for _ in blocks]
        for share in shares(record.global_batch, members):
            indices = order[record.cursor + share.start:record.cursor + share.stop]
            prediction = blocks[0].partial_prediction(indices)
            for block in blocks[1:]:  # the replica's allreduce over its ranks (two: one sum, either order)
                prediction = prediction + block.partial_prediction(indices)
            for rank, block in enumerate(blocks):
                contributions[rank].append(weighted(block.gradient(indices, prediction), len(share),
                                                    record.global_batch, members))
        for block, flats in zip(blocks, contributions):
            block.apply(ring_mean(flats))
    return [block.weights for block in blocks]
