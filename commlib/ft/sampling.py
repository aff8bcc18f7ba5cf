"""Which samples each replica trains on, and the ledger that proves every sample ran once.

The data of one pass (a *data epoch*) is a permutation of ``range(dataset_size)`` fixed by
``seed`` and the data epoch's number. A committed step consumes the next ``global_batch``
samples of it from the *cursor*: ``min(batch_size * members, left)``, split among the
members in rank order as evenly as possible (:func:`shares`). A discarded step consumes
nothing: it is redone by the next quorum, so a lost replica's share of it goes to the
survivors. When fewer samples are left than there are members (each must get one), they are
dropped and counted, never silently: the pass ends there.

The ledger is part of the state a joiner receives (:mod:`commlib.ft.catchup`), so every live
replica holds the whole history of committed steps: which members, which samples.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np

__all__ = ["permutation", "shares", "share_weight", "StepRecord", "Ledger"]


def permutation(dataset_size: int, seed: int, data_epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, data_epoch]).permutation(dataset_size)


def shares(global_batch: int, members: int) -> List[range]:
    """Positions (from the step's first sample) of each member's share: sizes differ by at most one."""
    base, extra = divmod(global_batch, members)
    bounds = [0]
    for rank in range(members):
        bounds.append(bounds[-1] + base + (1 if rank < extra else 0))
    return [range(bounds[rank], bounds[rank + 1]) for rank in range(members)]


def share_weight(share: int, global_batch: int, members: int) -> float:
    """What a member's mean gradient is scaled by before the average over ``members``, so that
    the result is the mean over the step's samples (1.0 when the shares are equal)."""
    return share * members / global_batch


@dataclasses.dataclass(frozen=True)
class StepRecord:
    step: int  # committed steps before this one
    epoch: int  # the quorum epoch it committed in
    members: List[str]
    data_epoch: int
    cursor: int  # position of its first sample in the data epoch's permutation
    global_batch: int


@dataclasses.dataclass
class Ledger:
    """The data position and the history of committed steps (see the module docstring)."""

    dataset_size: int = 0
    batch_size: int = 0
    seed: int = 0
    data_epoch: int = 0
    cursor: int = 0
    steps: List[StepRecord] = dataclasses.field(default_factory=list)
    dropped: Dict[int, int] = dataclasses.field(default_factory=dict)  # data epoch -> samples dropped

    @property
    def configured(self) -> bool:
        return self.dataset_size > 0

    def plan(self, members: int) -> int:
        """The global batch of the next step with ``members`` members (ending the pass first when
        fewer samples are left than members)."""
        if not self.configured:
            return 0
        left = self.dataset_size - self.cursor
        if left < members:
            if left:
                self.dropped[self.data_epoch] = self.dropped.get(self.data_epoch, 0) + left
            self.data_epoch, self.cursor = self.data_epoch + 1, 0
            left = self.dataset_size
        return min(self.batch_size * members, left)

    def indices(self, rank: int, members: int) -> np.ndarray:
        """Sample indices of member ``rank``'s share of the next step."""
        global_batch = self.plan(members)
        share = shares(global_batch, members)[rank]
        order = permutation(self.dataset_size, self.seed, self.data_epoch)
        return order[self.cursor + share.start:self.cursor + share.stop]

    def commit(self, epoch: int, members: List[str]) -> StepRecord:
        global_batch = self.plan(len(members))
        record = StepRecord(len(self.steps), epoch, list(members), self.data_epoch, self.cursor, global_batch)
        self.steps.append(record)
        self.cursor += global_batch
        return record

    # -- catch-up ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = dataclasses.asdict(self)
        data["dropped"] = {str(k): v for k, v in self.dropped.items()}
        return data

    @classmethod
    def from_json(cls, data: dict) -> "Ledger":
        data = dict(data)
        data["steps"] = [StepRecord(**step) for step in data["steps"]]
        data["dropped"] = {int(k): v for k, v in data["dropped"].items()}
        return cls(**data)

    def summary(self, replicas: Optional[List[str]] = None) -> dict:
        """Steps x replicas: per step its members and global batch; per data epoch the samples trained."""
        trained: Dict[int, int] = {}
        for record in self.steps:
            trained[record.data_epoch] = trained.get(record.data_epoch, 0) + record.global_batch
        return {"steps": len(self.steps),
                "replica_steps": sum(len(record.members) for record in self.steps),
                "members_per_step": [len(record.members) for record in self.steps],
                "global_batch_per_step": [record.global_batch for record in self.steps],
                "samples_per_data_epoch": trained, "dropped_per_data_epoch": dict(self.dropped)}
