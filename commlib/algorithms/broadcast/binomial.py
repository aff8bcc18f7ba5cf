"""``binomial`` broadcast: the root's buffer travels down a binomial tree, whole.

Ranks are numbered relative to the root (see :mod:`.binomial`). A rank receives the whole buffer
from its parent, then sends it to all its children at once, the largest subtree first. Invariant:
after round ``k`` (counting from the root's first send), the ``2^k`` relative ranks ``0 ..
2^k - 1`` hold the root's bytes. No segments: this is the small-message broadcast, where the
latency term dominates.

Cost (alpha-beta): ``ceil(log2 p)`` rounds of ``alpha + n beta`` on the critical path, ``p - 1``
messages in all; the root sends ``ceil(log2 p)`` copies of the buffer, so for large ``n`` the
chain or scatter-allgather broadcasts win. No extra memory.
"""

from __future__ import annotations

from commlib.algorithms.common.binomial import binomial_children, binomial_parent, real_rank, relative_rank

__all__ = ["broadcast_binomial"]


def broadcast_binomial(transport, buf, root: int, *, segment_bytes: int = 1 << 20) -> None:
    size = transport.size
    if size == 1 or buf.size == 0:
        return
    relative = relative_rank(transport.rank, root, size)
    parent = binomial_parent(relative, size)
    if parent >= 0:
        transport.step("binomial broadcast: receive from parent")
        transport.recv(buf, real_rank(parent, root, size))
    children = binomial_children(relative, size)
    if children:
        transport.step("binomial broadcast: send to children")
        transport.exchange(sends=[(buf, real_rank(child, root, size)) for child, _ in children])
