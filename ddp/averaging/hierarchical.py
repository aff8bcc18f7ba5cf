"""``HierarchicalModelAverager``: average often within small groups, rarely across all ranks.

    averager = HierarchicalModelAverager(OrderedDict([(2, 4), (8, 16)]), warmup_steps=100)

``period_group_size_dict`` maps periods (increasing) to group sizes; the last size must be the
whole group. At a step where several periods are due the largest wins: above, every 8 steps all
16 ranks average, at the other even steps each group of 4. Groups of 4 are consecutive ranks
after ordering ranks by host (the group's ``topology``, :mod:`ddp.subgroups`), so a group of a
host's size is a host: the slow links are crossed only at the largest period.

Counting differs from torch on purpose: periods are counted from the end of warm-up (step
``warmup_steps`` is the first average over everyone, as in ``PeriodicModelAverager``). torch's
counts from step 0: with warm-up 1 and period 2 it averages at steps 2, 4, ... where its own
PeriodicModelAverager averages at 1, 3, ..., so a one-level hierarchy is not the periodic
averager there (torch's test of that equivalence overwrites the hierarchical averager before
using it, so it never ran). Ours equals the periodic averager for every warm-up (tested).
A maximum period of 1 is allowed (torch refuses it as pointless; it is exact DDP-like averaging).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch

from ddp.averaging.averagers import ModelAverager
from ddp.subgroups import subgroups_of_size

__all__ = ["HierarchicalModelAverager"]


class HierarchicalModelAverager(ModelAverager):
    def __init__(self, period_group_size_dict=None, warmup_steps: int = 0, process_group=None, *,
                 average_buffers: bool = False, module: Optional[torch.nn.Module] = None,
                 follow_hosts: bool = True):
        super().__init__(process_group, warmup_steps=warmup_steps, average_buffers=average_buffers, module=module)
        who = type(self).__name__
        if not period_group_size_dict:
            raise ValueError(f"{who}: period_group_size_dict must map at least one period to a group size")
        levels = list(OrderedDict(period_group_size_dict).items())
        periods = [period for period, _ in levels]
        if any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in periods) \
                or periods != sorted(set(periods)):
            raise ValueError(f"{who}: the periods must be increasing positive integers, got {periods}")
        size = self.process_group.size
        if levels[-1][1] != size:
            raise ValueError(f"{who}: the last level's group size must be the whole group ({size} ranks), "
                             f"got {levels[-1][1]} (levels {levels})")
        self.periods = periods
        self.period_process_group_dict: "OrderedDict[int, object]" = OrderedDict()
        self._members = {}
        for period, group_size in levels:
            # Collective: every rank creates every level's groups, in the same order.
            group, members = subgroups_of_size(self.process_group, group_size, follow_hosts=follow_hosts)
            self.period_process_group_dict[period] = group
            self._members[period] = members

    def _due_period(self) -> Optional[int]:
        if self.step < self.warmup_steps:
            return None
        since_warmup = self.step - self.warmup_steps
        for period in reversed(self.periods):
            if since_warmup % period == 0:
                return period
        return None

    def _average(self, tensors, join, contribute) -> None:
        period = self._due_period()
        if period is not None:
            self._average_over(tensors, self.period_process_group_dict[period], self._members[period], join,
                               contribute)
