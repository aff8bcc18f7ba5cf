"""``binomial`` scatter: blocks flow down a binomial tree, each subtree's blocks as one message.

Ranks are numbered relative to the root (see :mod:`.binomial`); a subtree's relative ranks are
contiguous, so its blocks are one slice of a buffer in relative-rank order (the root rotates its
input into that order unless it is rank 0). A rank receives its whole subtree slice from its
parent (a leaf: straight into ``out``), sends each child the child's subtree slice, and keeps
the first block. Invariant: a rank holds its subtree's blocks before it sends any of them.

Cost (alpha-beta): ``ceil(log2 p) alpha + n (p-1)/p beta`` for ``n = p b`` elements. Extra
memory: an inner rank's subtree slice; ``n`` on a root other than rank 0.
"""

from __future__ import annotations

from commlib.algorithms.common.binomial import binomial_children, binomial_parent, real_rank, relative_rank, subtree_end

__all__ = ["scatter_binomial"]


def scatter_binomial(transport, out, inp, root: int, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    block = out.size
    if size == 1:
        transport.copy(out, inp)
        return
    if block == 0:
        return
    relative = relative_rank(rank, root, size)
    children = binomial_children(relative, size)
    parent = binomial_parent(relative, size)
    if not children:
        transport.step("binomial scatter: receive from parent")
        transport.recv(out, real_rank(parent, root, size))
        return
    end = subtree_end(relative, size)
    if relative == 0 and root == 0:
        subtree = inp
    else:
        subtree = transport.scratch((end - relative) * block, out.dtype, slot=1)
        if parent >= 0:
            transport.step("binomial scatter: receive from parent")
            transport.recv(subtree, real_rank(parent, root, size))
        else:  # rank order -> relative order
            transport.copy(subtree[:(size - root) * block], inp[root * block:])
            transport.copy(subtree[(size - root) * block:], inp[:root * block])
    transport.step("binomial scatter: send to children")
    transport.exchange(sends=[(subtree[(child - relative) * block:(child_end - relative) * block],
                               real_rank(child, root, size)) for child, child_end in children])
    transport.copy(out, subtree[:block])
