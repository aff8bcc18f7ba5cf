"""ddp.DistributedSampler against torch.utils.data.DistributedSampler, index for index."""

import itertools

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DistributedSampler as TorchSampler  # noqa: E402

from ddp.sampler import DistributedSampler  # noqa: E402

# Lengths around multiples of the world size, below it, and zero; worlds that do and don't divide.
LENGTHS = (0, 1, 2, 3, 7, 8, 9, 10, 100, 1797)
WORLDS = (1, 2, 3, 4, 8)


@pytest.mark.parametrize("shuffle,drop_last", list(itertools.product((True, False), repeat=2)))
def test_same_indices_as_torch(shuffle, drop_last):
    compared = 0
    for length, world, seed in itertools.product(LENGTHS, WORLDS, (0, 42)):
        data = list(range(length))
        for rank in range(world):
            ours = DistributedSampler(data, world, rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            theirs = TorchSampler(data, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed,
                                  drop_last=drop_last)
            for epoch in (0, 1, 5):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                expected = list(theirs)
                assert list(ours) == expected, (length, world, rank, seed, epoch)
                assert len(ours) == len(theirs) == len(expected)
                compared += 1
    assert compared > 500


def test_shards_partition_the_epoch():
    length, world = 1797, 4
    shards = [DistributedSampler(length, world, rank, seed=3) for rank in range(world)]
    for sampler in shards:
        sampler.set_epoch(2)
    seen = sorted(i for sampler in shards for i in sampler)
    # 1797 = 4 * 449 + 1: three indices are repeated to pad to 4 * 450.
    assert len(seen) == 1800 and set(seen) == set(range(length))
    dropped = [DistributedSampler(length, world, rank, seed=3, drop_last=True) for rank in range(world)]
    taken = [i for sampler in dropped for i in sampler]
    assert len(taken) == len(set(taken)) == 1796


def test_epochs_reshuffle_and_seed_matters():
    sampler = DistributedSampler(100, 2, 0, seed=1)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first
    assert list(DistributedSampler(100, 2, 0, seed=2)) != first


def test_works_as_a_dataloader_sampler():
    data = torch.arange(10.0)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=DistributedSampler(data, 2, 1, shuffle=False))
    batches = [b.tolist() for b in loader]
    assert batches == [[1.0, 3.0, 5.0, 7.0], [9.0]]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rank 2 is not in"):
        DistributedSampler(10, 2, 2)
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        DistributedSampler(10, 0, 0)
    with pytest.raises(ValueError, match="expected a data set or a length"):
        DistributedSampler(-1, 1, 0)
