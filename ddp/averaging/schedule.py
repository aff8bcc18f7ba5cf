"""Which elements of the parameters the partial-synchronization averager averages at which step.

A pure function from parameter sizes to a plan: ``plan[k]`` lists the pieces (parameter index,
first element, end element) averaged at step k of each period. Every element of every parameter
is in exactly one piece of exactly one step (tested as such).

* ``"balanced"`` (default): the parameters, concatenated in order, cut into ``period`` contiguous
  slices of equal size (+-1 element). Each step sends the same bytes, the least possible maximum,
  in one collective per dtype; a large layer spans neighbouring steps, a small one shares a step.
* ``"round_robin"``: parameter i at step i mod period, whole (the layer-wise baseline; its steps
  are as uneven as the layer sizes: one 16M-element matrix among 1k-element biases dominates).

Why no per-layer backward times: DreamDDP averages a layer in place once its backward is done
(no extra memory), so a layer finishing late in backward has little time left to hide its
communication, and the schedule must weigh layer sizes against per-layer backward times. Here a
step's slice is copied and sent when the previous step ends, before forward, so every slice has
the whole step (forward, backward, optimizer) to hide behind, whatever its layers' backward times;
the best schedule is then the most even one (2/period of the parameters' memory is the price).
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

__all__ = ["Piece", "plan_partial_sync", "STRATEGIES"]

STRATEGIES = ("balanced", "round_robin")


@dataclasses.dataclass(frozen=True)
class Piece:
    param: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_partial_sync(sizes: Sequence[int], period: int, strategy: str = "balanced") -> List[List[Piece]]:
    """``period`` lists of pieces covering every element of parameters of ``sizes`` exactly once."""
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"plan_partial_sync: period must be an integer >= 1, got {period!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"plan_partial_sync: strategy must be one of {STRATEGIES}, got {strategy!r}")
    sizes = [int(size) for size in sizes]
    if any(size < 0 for size in sizes):
        raise ValueError(f"plan_partial_sync: sizes must be >= 0, got {sizes}")
    plan: List[List[Piece]] = [[] for _ in range(period)]
    if strategy == "round_robin":
        for index, size in enumerate(sizes):
            if size:
                plan[index % period].append(Piece(index, 0, size))
        return plan
    total = sum(sizes)
    bounds = [(k * total) // period for k in range(period + 1)]
    param_start = 0
    for index, size in enumerate(sizes):
        param_end = param_start + size
        for step in range(period):
            low, high = max(bounds[step], param_start), min(bounds[step + 1], param_end)
            if low < high:
                plan[step].append(Piece(index, low - param_start, high - param_start))
        param_start = param_end
    return plan
