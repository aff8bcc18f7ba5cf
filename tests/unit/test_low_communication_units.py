"""The pure parts of DiLoCo / Streaming DiLoCo / DES-LOC (fragments, their schedule), and the
single-process references' optimizers against torch's (no MPI: the multi-rank checks are
tests/mpi/test_low_communication.py)."""

import pytest
import torch

from ddp.low_communication.fragments import check_delay, fragment_offsets, launches_within, split_parameters
from tests.support import low_communication_reference as reference


@pytest.mark.parametrize("sizes", [[10, 3, 5], [1], [7, 0, 7, 1, 100], [4096 * 1024, 4096, 4096 * 4096, 4096, 1024],
                                   [5, 5, 5, 5, 5, 5]])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_fragments_are_consecutive_nonempty_and_cover_every_parameter_once(sizes, count):
    if count > len(sizes):
        with pytest.raises(ValueError, match="at most"):
            split_parameters(sizes, count)
        return
    parts = split_parameters(sizes, count)
    assert len(parts) == count and all(parts)
    assert [i for part in parts for i in part] == list(range(len(sizes)))


def test_fragments_balance_equal_parameters_and_isolate_a_dominant_one():
    assert split_parameters([5] * 6, 3) == [[0, 1], [2, 3], [4, 5]]
    assert split_parameters([5] * 6, 2) == [[0, 1, 2], [3, 4, 5]]
    # One large matrix among small biases: it gets a fragment of its own, the rest share.
    parts = split_parameters([10, 1000, 10, 10], 2)
    assert parts in ([[0, 1], [2, 3]], [[0], [1, 2, 3]]), parts
    # Cuts that would leave a later fragment empty move back: one parameter each from the end.
    assert split_parameters([1, 1, 1, 1000], 3) == [[0, 1], [2], [3]]


@pytest.mark.parametrize("count", [0, -1, True, 2.0])
def test_fragment_count_must_be_a_positive_integer(count):
    with pytest.raises(ValueError, match="integer >= 1"):
        split_parameters([1, 2, 3], count)


def test_offsets_land_one_fragment_every_h_over_f_steps_the_last_at_h():
    assert fragment_offsets(12, 1) == [12]
    assert fragment_offsets(12, 3) == [4, 8, 12]
    assert fragment_offsets(10, 3) == [3, 6, 10]
    assert fragment_offsets(3, 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="sync_every >= 4"):
        fragment_offsets(3, 4)
    with pytest.raises(ValueError, match="sync_every must be an integer >= 1"):
        fragment_offsets(0, 1)


def test_delay_must_be_below_every_gap_between_landings():
    assert check_delay(3, [4, 8, 12]) == 3
    with pytest.raises(ValueError, match="smaller than the 4 inner steps"):
        check_delay(4, [4, 8, 12])
    with pytest.raises(ValueError, match="smaller than the 3 inner steps"):
        check_delay(3, [3, 6, 10])
    assert check_delay(49, [50]) == 49
    with pytest.raises(ValueError, match="integer >= 0"):
        check_delay(-1, [50])


@pytest.mark.parametrize("offset,delay,sync_every", [(4, 0, 12), (4, 2, 12), (12, 3, 12), (1, 0, 1), (6, 5, 6)])
def test_launches_within_counts_the_schedule(offset, delay, sync_every):
    for steps in range(40):
        expected = sum(1 for t in range(1, steps + 1) if (t - 1) % sync_every + 1 == offset - delay)
        assert launches_within(steps, offset, delay, sync_every) == expected, steps


def test_reference_adamw_and_adam_are_torchs():
    torch.manual_seed(0)
    for decoupled, cls in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        params = [torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
        mine = [p.clone() for p in params]
        theirs = [p.clone().requires_grad_(True) for p in params]
        optimizer = cls(theirs, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
        state: dict = {}
        for _ in range(6):
            grads = [torch.randn_like(p) for p in params]
            for p, g in zip(theirs, grads):
                p.grad = g.clone()
            optimizer.step()
            reference.adam_step(mine, grads, state, lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                                decoupled=decoupled)
            for a, b in zip(mine, theirs):
                torch.testing.assert_close(a, b.detach(), rtol=1e-13, atol=1e-15)
            for index, p in enumerate(theirs):
                torch.testing.assert_close(state["m"][index], optimizer.state[p]["exp_avg"], rtol=1e-13, atol=0)
                torch.testing.assert_close(state["v"][index], optimizer.state[p]["exp_avg_sq"], rtol=1e-13, atol=0)


def test_reference_nesterov_is_torchs():
    torch.manual_seed(1)
    params = [torch.randn(3, 3, dtype=torch.float64)]
    mine = [p.clone() for p in params]
    theirs = [p.clone().requires_grad_(True) for p in params]
    optimizer = torch.optim.SGD(theirs, lr=0.7, momentum=0.9, nesterov=True)
    state: dict = {}
    for _ in range(5):
        grads = [torch.randn_like(p) for p in params]
        theirs[0].grad = grads[0].clone()
        optimizer.step()
        reference.nesterov_step(mine, grads, state, lr=0.7, momentum=0.9)
        torch.testing.assert_close(mine[0], theirs[0].detach(), rtol=1e-13, atol=1e-15)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def _batch(step, rank):
    generator = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(4, 3, generator=generator, dtype=torch.float64),
            torch.randn(4, 2, generator=generator, dtype=torch.float64))


def test_reference_diloco_with_outer_sgd_lr_1_is_model_averaging():
    """With outer lr 1 and no momentum, theta' = theta - mean(theta - local) = mean(local): the
    reference DiLoCo is local training with periodic averaging (the outer step is the only
    difference between the two methods)."""
    inner = {"lr": 0.01}
    trajectory = reference.diloco(_mlp(), _batch, [6, 6], sync_every=3, fragments=[[0, 1, 2, 3]], inner=inner,
                                  outer_lr=1.0, outer_momentum=0.0)
    model = _mlp()
    local = [[p.detach().clone() for p in model.parameters()] for _ in range(2)]
    states: list = [{}, {}]
    for step in range(1, 7):
        for r in range(2):
            reference.adam_step(local[r], reference.gradients(model, local[r], *_batch(step - 1, r)), states[r],
                                **inner)
        if step % 3 == 0:
            for j in range(4):
                average = (local[0][j] + local[1][j]) / 2
                local[0][j], local[1][j] = average.clone(), average.clone()
        for r in range(2):
            for a, b in zip(trajectory[step - 1][r], local[r]):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert not torch.equal(trajectory[0][0][0], trajectory[0][1][0]), "the workers' data did not differ"


def test_reference_desloc_with_identical_data_is_adam():
    same = lambda step, rank: _batch(step, 0)  # noqa: E731 - every worker sees worker 0's data
    trajectory = reference.desloc(_mlp(), same, [5, 5, 5], periods=(1, 2, 3), adam={"lr": 0.01})
    model = _mlp()
    params = [p.detach().clone() for p in model.parameters()]
    state: dict = {}
    for step in range(5):
        reference.adam_step(params, reference.gradients(model, params, *_batch(step, 0)), state, lr=0.01)
        for r in range(3):
            for a, b in zip(trajectory[step][r]["params"], params):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
