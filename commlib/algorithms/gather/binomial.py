"""``binomial`` gather: blocks flow up a binomial tree, each subtree's blocks as one message.

Ranks are numbered relative to the root (see :mod:`.binomial`); a subtree's relative ranks are
contiguous, so its blocks are one slice of a buffer in relative-rank order. A rank puts its own
block first, receives each child's subtree slice behind it, and sends its whole subtree slice to
its parent (a leaf sends its input). Invariant: a rank sends only after its whole subtree
arrived; the root ends with every block, and rotates them from relative to rank order into
``out`` (it receives in place when it is rank 0).

Cost (alpha-beta): ``ceil(log2 p) alpha + n (p-1)/p beta`` for ``n = p b`` elements: the root
receives each block once, in ``log2 p`` messages instead of ``p - 1``. Extra memory: an inner
rank's subtree slice; ``n`` on a root other than rank 0.
"""

from __future__ import annotations

from commlib.algorithms.common.binomial import binomial_children, binomial_parent, real_rank, relative_rank, subtree_end

__all__ = ["gather_binomial"]


def gather_binomial(transport, out, inp, root: int, *, segment_bytes: int = 1 << 20) -> None:
    size, rank = transport.size, transport.rank
    block = inp.size
    if size == 1:
        transport.copy(out, inp)
        return
    if block == 0:
        return
    relative = relative_rank(rank, root, size)
    children = binomial_children(relative, size)
    parent = binomial_parent(relative, size)
    if not children:
        transport.step("binomial gather: send to parent")
        transport.send(inp, real_rank(parent, root, size))
        return
    end = subtree_end(relative, size)
    if relative == 0 and root == 0:
        subtree = out
    else:
        subtree = transport.scratch((end - relative) * block, inp.dtype, slot=1)
    transport.copy(subtree[:block], inp)
    transport.step("binomial gather: receive from children")
    transport.exchange(recvs=[(subtree[(child - relative) * block:(child_end - relative) * block],
                               real_rank(child, root, size)) for child, child_end in children])
    if parent >= 0:
        transport.step("binomial gather: send to parent")
        transport.send(subtree, real_rank(parent, root, size))
    elif root:  # relative order -> rank order
        transport.copy(out[root * block:], subtree[:(size - root) * block])
        transport.copy(out[:root * block], subtree[(size - root) * block:])
