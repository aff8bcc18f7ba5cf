"""The pure parts of communication-efficient DDP: the partial-sync plan, PowerSGD's linear
algebra and byte formula, argument checks (no MPI needed)."""

import numpy as np
import pytest
import torch

from ddp.averaging import plan_partial_sync
from ddp.hooks import PowerSGDState
from ddp.hooks.lowrank import orthogonalize_, payload_elements, should_compress


@pytest.mark.parametrize("sizes", [[10, 3, 5], [1], [7, 0, 7, 1, 100], [4096 * 1024, 4096, 4096 * 4096, 4096, 1024]])
@pytest.mark.parametrize("period", [1, 2, 3, 8])
@pytest.mark.parametrize("strategy", ["balanced", "round_robin"])
def test_partial_plan_covers_every_element_exactly_once(sizes, period, strategy):
    plan = plan_partial_sync(sizes, period, strategy)
    assert len(plan) == period
    covered = {index: [] for index in range(len(sizes))}
    for pieces in plan:
        for piece in pieces:
            assert 0 <= piece.start < piece.stop <= sizes[piece.param]
            covered[piece.param].append((piece.start, piece.stop))
    for index, ranges in covered.items():
        ranges.sort()
        position = 0
        for start, stop in ranges:
            assert start == position, f"param {index}: gap or overlap at {position}: {ranges}"
            position = stop
        assert position == sizes[index]
    per_step = [sum(piece.numel for piece in pieces) for pieces in plan]
    if strategy == "balanced":
        assert max(per_step) - min(per_step) <= 1, per_step
    else:
        assert all(piece.start == 0 and piece.stop == sizes[piece.param] for pieces in plan for piece in pieces)
        assert all(piece.param % period == step for step, pieces in enumerate(plan) for piece in pieces)


def test_partial_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="period"):
        plan_partial_sync([3], 0)
    with pytest.raises(ValueError, match="strategy"):
        plan_partial_sync([3], 2, "random")
    with pytest.raises(ValueError, match="sizes"):
        plan_partial_sync([3, -1], 2)


@pytest.mark.parametrize("rank", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_orthogonalize_gives_orthonormal_columns_spanning_the_input(rank, dtype):
    generator = torch.Generator().manual_seed(rank)
    matrix = torch.randn(12, rank, generator=generator, dtype=dtype)
    original = matrix.clone()
    orthogonalize_(matrix)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.allclose(matrix.T @ matrix, torch.eye(rank, dtype=dtype), atol=tolerance)
    # Same column space: projecting the input onto the columns gives it back.
    assert torch.allclose(matrix @ (matrix.T @ original), original, atol=tolerance * 10)


def test_orthogonalize_leaves_a_zero_column_zero_instead_of_nan():
    matrix = torch.zeros(6, 2, dtype=torch.float64)
    matrix[:, 1] = torch.arange(6.0)
    orthogonalize_(matrix)
    assert torch.isfinite(matrix).all()
    assert torch.equal(matrix[:, 0], torch.zeros(6, dtype=torch.float64))
    assert torch.isclose(matrix[:, 1].norm(), torch.tensor(1.0, dtype=torch.float64))
    zeros = torch.zeros(5, 1)
    orthogonalize_(zeros)
    assert torch.equal(zeros, torch.zeros(5, 1))


def test_compression_decision_and_payload_formula():
    assert should_compress(100, 100, 2, 2) == (True, 10000, 400)
    assert should_compress(10, 1, 1, 2) == (False, 10, 11)  # a bias is never worth it
    assert should_compress(10, 1, 1, 0) == (True, 10, 11)   # unless forced
    shapes = [(4096, 1024), (4096,), (4096, 4096), (4096,), (1024, 4096), (1024,), ()]
    expected = (4096 + 1024) * 2 + 4096 + (4096 + 4096) * 2 + 4096 + (1024 + 4096) * 2 + 1024 + 1
    assert payload_elements(shapes, 2, 2) == expected
    full = sum(int(np.prod(shape)) for shape in shapes)
    assert full / expected > 500  # the 25M MLP of ddp.bench at rank 2: ~550x fewer elements


@pytest.mark.parametrize("kwargs, match", [
    ({"matrix_approximation_rank": 0}, "matrix_approximation_rank"),
    ({"start_powerSGD_iter": 0}, "start_powerSGD_iter"),
    ({"min_compression_rate": -1}, "min_compression_rate"),
    ({"random_seed": 1.5}, "random_seed"),
])
def test_powersgd_state_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PowerSGDState(None, **kwargs)


def test_powersgd_state_round_trips_and_refuses_other_hyperparameters():
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=1, random_seed=3)
    state.rng.randint(10)
    state.iter = 7
    state.q_memory_dict[4] = torch.randn(3, 2)
    copy = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=1, random_seed=3)
    copy.load_state_dict(state.state_dict())
    assert copy.iter == 7 and torch.equal(copy.q_memory_dict[4], state.q_memory_dict[4])
    assert copy.rng.randint(1 << 30) == state.rng.randint(1 << 30)
    other = PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="matrix_approximation_rank=2 in the checkpoint"):
        other.load_state_dict(state.state_dict())
    # With neither error feedback nor warm start nothing is memorised: step 0 is allowed.
    PowerSGDState(None, start_powerSGD_iter=0, use_error_feedback=False, warm_start=False)


def test_comm_hook_results_are_work_handles_or_torch_futures():
    from commlib import WorkHandle
    from commlib.execution.work import Work
    from ddp.hooks import CompletedWork, HookWork

    assert isinstance(CompletedWork(torch.zeros(2)), WorkHandle)
    assert isinstance(HookWork(Work("allreduce"), lambda: None), WorkHandle)
    # torch's future is the other half of HookResult: done()/then(), not our protocol
    assert not isinstance(torch.futures.Future(), WorkHandle)
