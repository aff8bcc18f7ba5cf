"""The binomial tree shared by the rooted schedules (broadcast, reduce, gather, scatter).

Ranks are renumbered **relative** to the root, ``v = (rank - root) mod p``, so every rooted
schedule is written once for root 0. In the tree, ``v``'s parent is ``v`` minus its lowest set
bit and its children are ``v + 2^k`` for every ``2^k`` below that bit (for the root: below ``p``
rounded up to a power of two) that is still ``< p``. A child ``c = v + 2^k`` roots the
**subtree** of relative ranks ``[c, min(c + 2^k, p))``: contiguous, so the blocks of a subtree
are one slice of a buffer laid out in relative-rank order. Depth ``ceil(log2 p)``, ``p - 1``
edges.
"""

from __future__ import annotations

from typing import List, Tuple

__all__ = ["binomial_parent", "binomial_children", "subtree_end", "relative_rank", "real_rank"]


def relative_rank(rank: int, root: int, size: int) -> int:
    return (rank - root) % size


def real_rank(relative: int, root: int, size: int) -> int:
    return (relative + root) % size


def _lowest_bit(relative: int, size: int) -> int:
    """``relative``'s lowest set bit; for the root, ``size`` rounded up to a power of two."""
    if relative == 0:
        return 1 << max(size - 1, 0).bit_length()
    return relative & -relative


def binomial_parent(relative: int, size: int) -> int:
    """The parent's relative rank, or -1 for the root."""
    return relative - _lowest_bit(relative, size) if relative else -1


def subtree_end(relative: int, size: int) -> int:
    """One past the last relative rank of ``relative``'s subtree."""
    return min(relative + _lowest_bit(relative, size), size)


def binomial_children(relative: int, size: int) -> List[Tuple[int, int]]:
    """``[(child, child's subtree end)]``, the largest subtree first."""
    children = []
    mask = _lowest_bit(relative, size) >> 1
    while mask:
        child = relative + mask
        if child < size:
            children.append((child, min(child + mask, size)))
        mask >>= 1
    return children
