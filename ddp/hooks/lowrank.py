"""The linear algebra of PowerSGD (Vogels et al., NeurIPS 2019), free of communication.

Terms: a gradient tensor is viewed as an n x m matrix M (its first dimension by all the others).
With rank r, PowerSGD sends P = M Q (n x r) and Q = M^T P (m x r) instead of M, (n + m) r
elements instead of n m; a matrix is compressed only where that pays at least
``min_compression_rate`` times. The decompressed gradient is P Q^T, the projection of the
averaged M onto the span of the orthonormalised P: exact when r = min(n, m).
"""

from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

__all__ = ["matrix_shape", "should_compress", "orthogonalize_", "payload_elements"]


def matrix_shape(shape: Tuple[int, ...]) -> Optional[Tuple[int, int]]:
    """(n, m) of the matrix view of a tensor of ``shape``; None for a 0-d tensor (never compressed)."""
    if len(shape) == 0:
        return None
    n = int(shape[0])
    m = 1
    for dim in shape[1:]:
        m *= int(dim)
    return n, m


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> Tuple[bool, int, int]:
    """(compress?, elements sent uncompressed, elements sent compressed) for an n x m matrix."""
    uncompressed = n * m
    compressed = (n + m) * rank
    return compressed * min_compression_rate < uncompressed, uncompressed, compressed


def effective_rank(n: int, m: int, rank: int) -> int:
    return min(n, m, rank)


def payload_elements(shapes: Iterable[Tuple[int, ...]], rank: int, min_compression_rate: float) -> int:
    """Elements one PowerSGD step sends for tensors of ``shapes``: sum of (n + m) r over the
    compressed matrices plus every element of the others (the byte formula, over the itemsize)."""
    total = 0
    for shape in shapes:
        nm = matrix_shape(tuple(shape))
        if nm is None:
            total += 1
            continue
        n, m = nm
        r = effective_rank(n, m, rank)
        compress, uncompressed, compressed = should_compress(n, m, r, min_compression_rate)
        total += compressed if compress else uncompressed
    return total


def orthogonalize_(matrix: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Make the columns of ``matrix`` (n x r, r <= n) orthonormal, in place.

    Gram-Schmidt for r <= 2 and half precision (where QR is missing or slower), QR otherwise,
    as torch does. Unlike torch, a column that is all zeros stays zeros instead of becoming NaN
    (torch divides by its zero norm; a joined rank's zero gradients or a layer without signal
    would otherwise poison every rank's gradient).
    """
    rank = matrix.shape[1]
    if rank > 2 and matrix.dtype not in (torch.float16, torch.bfloat16):
        q, _ = torch.linalg.qr(matrix)
        matrix.copy_(q)
        return matrix
    for i in range(rank):
        column = matrix[:, i:i + 1]
        norm = torch.norm(column, dim=0, keepdim=True)
        if epsilon == 0:
            column.copy_(torch.where(norm > 0, column / norm, torch.zeros_like(column)))
        else:
            column /= norm + epsilon
        if i + 1 < rank:
            rest = matrix[:, i + 1:]
            rest -= torch.sum(column * rest, dim=0, keepdim=True) * column
    return matrix
