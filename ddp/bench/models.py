"""The models the DDP benchmarks train, and the process-memory readings they report."""

from __future__ import annotations

import os

import torch

__all__ = ["MODELS", "build_model", "rss_bytes", "pss_bytes", "set_mmap_threshold"]

MODELS = ("mlp", "transformer", "tiny")


def build_model(name: str):
    """``(model, make_batch(batch) -> (x, y), default per-rank batch)`` of the model named ``name``."""
    if name == "mlp":  # 1024-4096-4096-1024: 25.2M parameters
        model: torch.nn.Module = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096), torch.nn.ReLU(),
            torch.nn.Linear(4096, 1024))
        return model, (lambda batch: (torch.randn(batch, 1024), torch.randn(batch, 1024))), 128
    if name == "transformer":  # 3 layers, d512, ff2048, seq 128: 9.5M parameters
        layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        return model, (lambda batch: (torch.randn(batch, 128, 512), torch.randn(batch, 128, 512))), 4
    if name == "tiny":  # 128-512-128: 0.13M parameters; for smoke tests of the benchmarks, not for figures
        model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
        return model, (lambda batch: (torch.randn(batch, 128), torch.randn(batch, 128))), 8
    raise SystemExit(f"unknown --model {name!r}; expected one of {', '.join(MODELS)}")


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pss_bytes() -> int:
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def set_mmap_threshold(threshold_bytes: int) -> None:
    """Fix glibc's mmap threshold (and its trim threshold at twice that), as ``mallopt`` does.

    For the memory pass, 1 MiB: glibc raises its threshold after big frees (up to 32 MiB) and
    then keeps freed tensors in the heap, so RSS deltas would mean nothing. For the step times,
    32 MiB, where glibc's own adaptation ends up: with 1 MiB every tensor costs an mmap and fresh
    zeroed pages, which made a transformer step 468 ms instead of 332 ms (its communication 110
    ms instead of 45-49) in an A/B run.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, threshold_bytes)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 2 * threshold_bytes)  # M_TRIM_THRESHOLD
    except OSError:
        pass
