"""The training of the fault-tolerance tests, and its replay without failures (the reference).

:func:`build` gives every replica the same model and data (seeded); :func:`replay` trains one
model through the committed steps of a run's ledger, computing each member's share and
averaging the members' gradients with the same ring allreduce (its threads over the in-process
transport run the same schedule as the sockets), so a run whose steps were committed as
recorded ends bitwise where the replay ends.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np
import torch

from commlib.ft import Ledger
from commlib.ft.sampling import permutation, shares
from ddp.fault_tolerant import flatten_gradients, pseudo_gradient, unflatten_gradients
from tests.support.ft_replay import ring_mean, weighted

__all__ = ["DATASET_SIZE", "BATCH_SIZE", "SEED", "build", "optimizer", "inner_optimizer", "outer_optimizer", "loss",
           "own_batch", "replay", "replay_diloco", "replay_own_data", "sample_counts"]

DATASET_SIZE = 60
BATCH_SIZE = 4
SEED = 7


def build() -> Tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(SEED)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    generator = torch.Generator().manual_seed(SEED + 1)
    inputs = torch.randn(DATASET_SIZE, 6, generator=generator)
    targets = torch.randn(DATASET_SIZE, 2, generator=generator)
    return net, inputs, targets


def optimizer(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # momentum: optimizer state a joiner needs


def inner_optimizer(params):
    """DiLoCo's inner optimizer in the tests: without state, so that a replay can train each
    member's share from the round's start (the replicas keep theirs across rounds)."""
    return torch.optim.SGD(params, lr=0.1)


def outer_optimizer(params):
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)  # the paper's outer optimizer


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)


def replay(ledger_json: dict, local_size: int = 1) -> List[torch.Tensor]:
    """The parameters after the ledger's committed steps, trained without failures.
    ``local_size``: replicas of that many ranks, each training on its part of its replica's
    share; the parts' gradients averaged inside the replica first (``Manager.average_over_replica``)."""
    ledger, net, inputs, targets, params = _fresh(ledger_json)
    opt = optimizer(net.parameters())
    for record in ledger.steps:
        members = len(record.members)
        order = permutation(ledger.dataset_size, ledger.seed, record.data_epoch)
        flats = []
        for share in shares(record.global_batch, members):
            share_indices = order[record.cursor + share.start:record.cursor + share.stop]
            replica_mean = _replica_mean(net, inputs, targets, params, share_indices, local_size)
            flats.append(weighted(replica_mean, len(share), record.global_batch, members))
        unflatten_gradients(params, torch.from_numpy(ring_mean(flats)))
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def replay_diloco(ledger_json: dict, sync_every: int, local_size: int = 1) -> List[torch.Tensor]:
    """The parameters after the ledger's committed DiLoCo rounds (``sync_every`` inner steps
    each), trained without failures: each member's share from the round's start, their
    pseudo-gradients averaged with the ring, the outer step (as ddp.FaultTolerantDiLoCo does).
    ``local_size``: replicas of that many ranks, each inner batch split over them, their
    gradients averaged inside the replica before each inner step (``Manager.replica_mean``)."""
    ledger, net, inputs, targets, params = _fresh(ledger_json)
    outer = outer_optimizer(net.parameters())
    for record in ledger.steps:
        members = len(record.members)
        order = permutation(ledger.dataset_size, ledger.seed, record.data_epoch)
        start = [p.detach().clone() for p in params]
        flats = []
        for share in shares(record.global_batch, members):
            with torch.no_grad():
                for param, first in zip(params, start):
                    param.copy_(first)
            inner = inner_optimizer(net.parameters())
            indices = order[record.cursor + share.start:record.cursor + share.stop]
            for chunk in [chunk for chunk in np.array_split(indices, sync_every) if chunk.size]:
                gradient = _replica_mean(net, inputs, targets, params, chunk, local_size)
                unflatten_gradients(params, torch.from_numpy(gradient))
                inner.step()
            flats.append(_weighted(pseudo_gradient(start, params), len(share), record.global_batch, members))
        mean = ring_mean(flats)
        with torch.no_grad():
            for param, first in zip(params, start):
                param.copy_(first)
        for param in params:
            param.grad = None
        unflatten_gradients(params, torch.from_numpy(mean))
        outer.step()
    return [p.detach().clone() for p in net.parameters()]


def own_batch(step: int, member: int, local_rank: int) -> np.ndarray:
    """The samples local rank ``local_rank`` of quorum member ``member`` trains on in committed
    step ``step`` when the training chooses its own data (no ``Manager.configure_data``): parts
    of different sizes, so that the plain mean of a replica's ranks, which the manager takes
    without sample accounting, differs from a mean weighted by the parts."""
    size = 3 + 2 * local_rank
    start = (11 * step + 5 * member + 2 * local_rank) % (DATASET_SIZE - size)
    return np.arange(start, start + size)


def replay_own_data(ledger_json: dict, local_size: int) -> List[torch.Tensor]:
    """The parameters after the ledger's committed steps, trained without failures, for a run
    without sample accounting on replicas of ``local_size`` ranks: each rank's mean gradient over
    :func:`own_batch`, the plain mean of the replica's ranks, then the plain mean of the members."""
    ledger, net, inputs, targets, params = _fresh(ledger_json)
    opt = optimizer(net.parameters())
    for record in ledger.steps:
        members = len(record.members)
        flats = []
        for member in range(members):
            parts = []
            for local_rank in range(local_size):
                net.zero_grad()
                batch = torch.from_numpy(own_batch(record.step, member, local_rank))
                loss(net(inputs[batch]), targets[batch]).backward()
                parts.append(flatten_gradients(params).numpy())  # (a fresh buffer: plain mean, no weight)
            flats.append(ring_mean(parts))
        unflatten_gradients(params, torch.from_numpy(ring_mean(flats)))
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _replica_mean(net, inputs, targets, params, batch: np.ndarray, local_size: int) -> np.ndarray:
    """The mean gradient over ``batch`` of a replica of ``local_size`` ranks, as its managers
    compute it: ``batch`` split over the ranks, each part's mean gradient (zeros for an empty
    one) weighted by its size, summed with the ring, divided (one rank: the batch's gradient)."""
    parts = []
    for part in shares(len(batch), local_size):
        net.zero_grad()
        indices = torch.from_numpy(batch[part.start:part.stop])
        if len(indices):
            loss(net(inputs[indices]), targets[indices]).backward()
        parts.append(_weighted(flatten_gradients(params), len(part), len(batch), local_size))
    return ring_mean(parts)


def _fresh(ledger_json: dict):
    """A replay's start: the ledger, the untrained model and data, the trained parameters."""
    torch.set_num_threads(1)
    net, inputs, targets = build()
    return Ledger.from_json(ledger_json), net, inputs, targets, [p for p in net.parameters() if p.requires_grad]


def _weighted(flat: torch.Tensor, share: int, global_batch: int, members: int) -> np.ndarray:
    return weighted(flat.numpy(), share, global_batch, members)


def sample_counts(ledger_json: dict) -> dict:
    """{data epoch: array of how many times each sample was trained} over the committed steps
    (empty for a ledger without sample accounting: no ``configure_data``)."""
    ledger = Ledger.from_json(ledger_json)
    if not ledger.configured:
        return {}
    counts: dict = {}
    for record in ledger.steps:
        order = permutation(ledger.dataset_size, ledger.seed, record.data_epoch)
        seen = counts.setdefault(record.data_epoch, np.zeros(ledger.dataset_size, np.int64))
        np.add.at(seen, order[record.cursor:record.cursor + record.global_batch], 1)
    return counts
