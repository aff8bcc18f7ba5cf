"""Pipelined forwarding down a tree, shared by the tree allreduce and the chain broadcast.

The buffer is cut into **segments**; a rank receives each segment from its parent straight into
the buffer (up to ``window`` later receives already posted) and forwards it to its children,
keeping up to ``window`` forwards in flight. Without a parent (the root) it only forwards.
"""

from __future__ import annotations

import collections
from typing import Deque

from commlib.transports.interface import Pending

__all__ = ["forward_segments", "drain"]


def drain(pendings, keep: int) -> None:
    """Complete the oldest pending steps until at most ``keep`` remain."""
    while len(pendings) > keep:
        pendings.popleft().wait()


def forward_segments(transport, buf, segments, parent: int, children, window: int, label: str) -> None:
    count = len(segments)
    step, post = transport.step, transport.post
    incoming: Deque[Pending] = collections.deque()
    outgoing: Deque[Pending] = collections.deque()
    posted = 0
    for index, (lo, hi) in enumerate(segments):
        step(f"{label} segment {index}")
        if parent >= 0:
            while posted < min(count, index + 1 + window):
                p_lo, p_hi = segments[posted]
                incoming.append(post((), ((buf[p_lo:p_hi], parent),)))
                posted += 1
            incoming.popleft().wait()
        if children:
            outgoing.append(post([(buf[lo:hi], child) for child in children], ()))
            drain(outgoing, window)
    step(label)
    drain(outgoing, 0)
