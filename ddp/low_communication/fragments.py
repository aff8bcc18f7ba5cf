"""Streaming DiLoCo's fragments and their schedule: pure functions, no communication.

Terms. ``H`` (``sync_every``) inner steps make a *round*; the model's trainable parameters are
cut into ``F`` *fragments* (whole parameters: an outer optimizer steps whole tensors); fragment
``i`` has its *offset* ``o_i = floor((i + 1) H / F)`` within the round. Counting inner steps
``t = 1, 2, ...`` from the start of the low-communication phase:

* fragment ``i``'s pseudo-gradient is *launched* (computed and handed to an asynchronous
  allreduce) right after step ``t`` with ``t = o_i - tau (mod H)``;
* it *lands* (the allreduce is waited for, the outer optimizer steps the fragment) right after
  step ``t = o_i (mod H)``, ``tau`` (``fragment_sync_delay``) inner steps later.

The last fragment lands at ``t = 0 (mod H)``, so with one fragment this is DiLoCo's "after step
t when t % H == 0"; with ``F`` fragments one lands every ``H / F`` steps (torchft's schedule),
each fragment once per round. ``tau`` must be smaller than every gap between consecutive
offsets, so at most one fragment is in flight at a time and each lands before the next launches.
In the first round fragment ``i``'s pseudo-gradient covers ``o_i - tau`` steps, later ones ``H``.
"""

from __future__ import annotations

from typing import List, Sequence

__all__ = ["split_parameters", "fragment_offsets", "check_delay", "launches_within"]


def split_parameters(sizes: Sequence[int], count: int) -> List[List[int]]:
    """Parameter indices of ``count`` fragments of consecutive parameters of ``sizes`` elements:
    fragment ``k`` ends before the parameter whose start is nearest ``(k + 1) / count`` of the total,
    moved when needed so that every fragment holds at least one parameter."""
    sizes = [int(size) for size in sizes]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"fragments: a count of fragments must be an integer >= 1, got {count!r}")
    if count > len(sizes):
        raise ValueError(f"fragments: {count} fragments of {len(sizes)} trainable parameters; a fragment holds "
                         f"whole parameters, so at most {len(sizes)}")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    total, last = prefix[-1], len(sizes)
    cuts = [0]
    for k in range(1, count):
        # At least one parameter for this fragment and for each one after it.
        nearest = min(range(1, last), key=lambda j: (abs(prefix[j] * count - k * total), j))
        cuts.append(min(max(nearest, cuts[-1] + 1), last - (count - k)))
    cuts.append(last)
    return [list(range(a, b)) for a, b in zip(cuts, cuts[1:])]


def fragment_offsets(sync_every: int, count: int) -> List[int]:
    """``o_i = floor((i + 1) H / F)``: where in a round fragment ``i`` lands (1..H, increasing)."""
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
    if count > sync_every:
        raise ValueError(f"{count} fragments need sync_every >= {count} (one fragment lands per step at most), "
                         f"got sync_every={sync_every}")
    return [((i + 1) * sync_every) // count for i in range(count)]


def check_delay(delay: int, offsets: Sequence[int]) -> int:
    """``tau`` must be below every gap between consecutive landings (the first gap counts from 0)."""
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"fragment_sync_delay must be an integer >= 0, got {delay!r}")
    gaps = [b - a for a, b in zip([0, *offsets[:-1]], offsets)]
    if delay >= min(gaps):
        raise ValueError(f"fragment_sync_delay={delay} must be smaller than the {min(gaps)} inner steps between "
                         f"two fragments' synchronisations (offsets {list(offsets)} in a round of "
                         f"{offsets[-1]}): a fragment must land before the next one is sent")
    return delay


def launches_within(steps: int, offset: int, delay: int, sync_every: int) -> int:
    """How many times a fragment with ``offset`` is launched in inner steps ``1..steps``."""
    first = offset - delay
    return 0 if steps < first else 1 + (steps - first) // sync_every
