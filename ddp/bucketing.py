"""Which gradients share a bucket: a pure function from parameter specs to a bucket plan.

The paper's rule (Li et al., section 3.2.3): walk the parameters in the order their gradients are
expected to become ready (reverse registration order before the first iteration, the observed
order after it), and pack them into flat buffers of about ``cap_bytes``, the first one of about ``first_cap_bytes``
(small, so the first allreduce starts early in backward). As in torch, a bucket is closed as soon
as it reaches its cap, so its last parameter may take it past the cap; a cap below every
parameter's size gives each parameter a bucket of its own. A bucket holds one
dtype on one device, because it is one flat buffer handed to one collective; each (dtype, device)
pair fills its own open bucket.

Buckets are numbered by the position of their first parameter in the walk, so bucket 0 is the one
expected to be ready first. Every rank computes the same plan from the same specs and order.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["ParamSpec", "BucketPlan", "plan_buckets", "MiB"]

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    numel: int
    itemsize: int
    dtype: str
    device: str = "cpu"

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    params: Tuple[int, ...]     # parameter indices, in the order they sit in the flat buffer
    offsets: Tuple[int, ...]    # element offset of each parameter in the flat buffer
    numel: int
    dtype: str
    device: str


def plan_buckets(specs: Sequence[ParamSpec], cap_bytes: float, first_cap_bytes: Optional[float] = None,
                 order: Optional[Sequence[int]] = None) -> List[BucketPlan]:
    """Bucket plan for ``specs``; ``order`` lists every index once (default: reverse registration)."""
    if not cap_bytes > 0:
        raise ValueError(f"plan_buckets: cap_bytes must be > 0, got {cap_bytes!r}")
    if first_cap_bytes is None:
        first_cap_bytes = cap_bytes
    if not first_cap_bytes > 0:
        raise ValueError(f"plan_buckets: first_cap_bytes must be > 0, got {first_cap_bytes!r}")
    if order is None:
        order = list(range(len(specs) - 1, -1, -1))
    else:
        order = [int(i) for i in order]
        if sorted(order) != list(range(len(specs))):
            raise ValueError(f"plan_buckets: order must list each of the {len(specs)} parameter "
                             f"indices exactly once, got {order}")

    closed: List[Tuple[int, List[int], Tuple[str, str]]] = []  # (first position, members, key)
    open_buckets: Dict[Tuple[str, str], Tuple[int, List[int], int]] = {}
    first_filled = set()  # keys whose first bucket is closed: later ones use cap_bytes

    for position, index in enumerate(order):
        spec = specs[index]
        key = (spec.dtype, spec.device)
        start, members, size = open_buckets.get(key, (position, [], 0))
        members.append(index)
        size += spec.nbytes
        cap = cap_bytes if key in first_filled else first_cap_bytes
        if size >= cap:
            closed.append((start, members, key))
            first_filled.add(key)
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (start, members, size)
    for key, (start, members, _) in open_buckets.items():
        closed.append((start, members, key))
    closed.sort(key=lambda entry: entry[0])

    plans = []
    for _, members, (dtype, device) in closed:
        offsets, total = [], 0
        for index in members:
            offsets.append(total)
            total += specs[index].numel
        plans.append(BucketPlan(tuple(members), tuple(offsets), total, dtype, device))
    return plans
