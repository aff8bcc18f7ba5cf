"""The small float64 model and per-rank batches that the local-SGD and low-communication rank
scripts train: the same weights on every rank (seed 0), batches that differ by step and rank."""

import torch

__all__ = ["mlp", "batch"]


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3)).double()


def batch(step: int, rank: int):
    """``(inputs, targets)`` of rank ``rank`` at ``step``: 5 samples, 6 features in, 3 out."""
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(5, 6, generator=generator, dtype=torch.float64),
            torch.randn(5, 3, generator=generator, dtype=torch.float64))
