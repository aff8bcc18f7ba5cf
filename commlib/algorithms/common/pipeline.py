"""The pipelined exchange loop shared by ring, recursive doubling and rabenseifner.

A schedule is a list of **stages**; a stage is the transfers of one segment (``sends`` and
``recvs``, ``(slice, peer)`` pairs) plus, optionally, the local reduce that consumes what it
received. The loop keeps up to ``window`` later stages posted while it reduces the current one,
so the transport moves segment ``i + 1`` while the CPU (or GPU stream) combines segment ``i``.

Dependencies are expressed by one number, the **lag**: stage ``j`` sends what stage ``j - lag``
reduced (ring: the same segment one step earlier, ``lag`` = segments per chunk), so it is posted
only after that stage finished. Received segments land in ``window + 1`` rotating scratch slots:
one being reduced, ``window`` in flight.
"""

from __future__ import annotations

import collections
from typing import Any, Deque, List, NamedTuple, Optional, Sequence, Tuple

from commlib.ops import ReduceOp
from commlib.transports.interface import Pending

__all__ = ["Stage", "run_stages", "PIPELINE_WINDOW", "scratch_slots"]

# Stages in flight beyond the one being reduced: with 4 a 64 MiB ring at P=2 took ~20% less time
# than with 1 (the receives are posted before the data arrives); 8 was no better.
PIPELINE_WINDOW = 4


class Stage(NamedTuple):
    label: str
    sends: Sequence[Tuple[object, int]]
    recvs: Sequence[Tuple[object, int]]
    # (dst, src, src_first): dst = dst (op) src once the stage completed, or None (a plain copy).
    combine: Optional[Tuple[object, object, bool]] = None


def scratch_slots(transport, segment_elems: int, dtype, window: int = PIPELINE_WINDOW,
                  scratch_slot: int = 0) -> List[Any]:
    """``window + 1`` segment-sized receive slots carved from one transport scratch buffer.

    Schedules that need two independent sets of slots take them from different ``scratch_slot``s.
    """
    slots = window + 1
    pool = transport.scratch(slots * segment_elems, dtype, slot=scratch_slot)
    return [pool[slot * segment_elems:(slot + 1) * segment_elems] for slot in range(slots)]


def run_stages(transport, stages: Sequence[Stage], op: ReduceOp, *, lag: int,
               window: int = PIPELINE_WINDOW) -> None:
    """Run ``stages`` in order; stage ``j`` is posted after stage ``j - lag`` was reduced."""
    count = len(stages)
    if lag < 1:
        raise ValueError(f"pipeline lag must be >= 1, got {lag}")
    post, reduce, step = transport.post, transport.reduce, transport.step
    in_flight: Deque[Pending] = collections.deque()
    posted = 0
    for index in range(count):
        # Stages < index are finished, stage ``index`` is not: j - lag < index.
        bound = min(count, index + 1 + window, index + lag)
        while posted < bound:
            stage = stages[posted]
            step(stage.label)
            in_flight.append(post(stage.sends, stage.recvs))
            posted += 1
        stage = stages[index]
        step(stage.label)
        in_flight.popleft().wait()
        combine = stage.combine
        if combine is not None:
            reduce(combine[0], combine[1], op, combine[2])
