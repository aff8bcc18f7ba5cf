"""What the torch backend scripts share to hold the "commlib" backend against gloo, bit for bit.

Each operation runs on the "commlib" group and on a gloo group of the same ranks with the same
inputs (:func:`on_both`); :func:`make` derives those inputs from a seed, so a result can also be
held against the sender's tensor rebuilt locally.
"""

import torch


def make(shape, dtype, seed):
    """A tensor of ``shape`` and ``dtype`` with values fixed by ``seed`` (every rank can rebuild it)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(0, 100, shape, generator=g).to(dtype)


def same_bits(checker, ours, theirs, what):
    """Same shape, dtype and bytes (NaN payloads and -0.0 included), else a failure naming both."""
    ok = ours.shape == theirs.shape and ours.dtype == theirs.dtype and torch.equal(
        ours.reshape(-1).view(torch.uint8) if ours.numel() else ours,
        theirs.reshape(-1).view(torch.uint8) if theirs.numel() else theirs)
    checker.check(ok, lambda: f"{what}: commlib {tuple(ours.shape)} {ours.dtype} {ours.reshape(-1)[:6].tolist()} "
                              f"vs gloo {tuple(theirs.shape)} {theirs.dtype} {theirs.reshape(-1)[:6].tolist()}")


def on_both(gloo, fn):
    """Run ``fn(group)`` on the commlib (default) group and on gloo; return both results."""
    return fn(None), fn(gloo)
