"""Slow replicas: measure every member's links, and name the one that holds the quorum back.

A synchronous average runs at the pace of its slowest link: one host whose network turned slow
(a bad cable, a saturated top-of-rack switch, a neighbour's traffic) slows every step of every
replica, and it still heartbeats, so nothing else would drop it. :class:`SlowReplicas` is the
policy a :class:`commlib.ft.Manager` is given to find such a member and exclude it:

* **When it probes**: when an epoch of at least three members starts (before the catch-up: a
  joiner that is still slow is sent back without a transfer over its slow link), every
  ``every`` committed steps, and at the step after a member's gradient allreduce took
  ``slow_step`` times its median over the epoch's last 64 steps. All members decide alike
  (the step count and the vote they share), so the probe is a collective.
* **What it measures** (:func:`probe_links`): in the rounds of a round-robin tournament
  (:func:`pairings`), each member exchanges ``probe_bytes`` both ways with one partner, so all
  of a member's traffic in a round is with one peer, and a flow to a slow peer never shares a
  round with a flow to a fast one. Every pair meets once per repeat. Partners first tell each
  other that they are in the round (one that sat the last round out would otherwise start its
  clock while its partner still works on the last). The receiver times the payload from the
  moment it tells the sender to go (one small message back over the link: a latency, small
  beside ``probe_bytes`` at link speed). Each link keeps its best of ``repeats`` rounds (a
  member that was descheduled once is not slow), and the matrix is allgathered: every member
  holds the same bytes and so reaches the same verdict.
* **Who is slow** (:func:`slowest_member`): a member's score is the lesser of its best sending
  and its best receiving link. A healthy member has at least one fast link each way (to another
  healthy member), a member whose own link is slow has none; so with three members or more the
  slow one stands out, whichever direction is slow. With two, a slow link is both members'
  (neither can be told from the other) and nobody is excluded. It is slow when its score is under
  ``ratio`` times the median score and, if ``below`` is set, under ``below`` bytes/s; at most one
  member is named per probe.

The verdict goes to the coordinator as the epoch's close (``slow <replica> ...``); the
coordinator keeps that replica out of quorums for its probation (doubled each time it is found
slow again), then lets it join: the probe at the start of that epoch decides whether it stays.
"""

from __future__ import annotations

import dataclasses
import time
from typing import List, Optional

import numpy as np

from commlib.errors import InvalidUsageError

__all__ = ["SlowReplicas", "SlowMember", "pairings", "probe_links", "slowest_member", "PROBE_TAG", "GO_TAG",
           "READY_TAG"]

#: The tags of the probe's payloads, go-aheads and round starts (catch-up's is 1; nothing else
#: on a replica group is point to point): one each, since a partner sends every kind.
PROBE_TAG, GO_TAG, READY_TAG = 2, 3, 4


@dataclasses.dataclass(frozen=True)
class SlowReplicas:
    """How a :class:`commlib.ft.Manager` finds a slow member (see the module docstring)."""

    ratio: float = 0.1
    below: Optional[float] = None
    probe_bytes: int = 256 << 10
    repeats: int = 2
    every: int = 0
    slow_step: float = 4.0

    def __post_init__(self):
        if not 0.0 < self.ratio < 1.0:
            raise InvalidUsageError(f"SlowReplicas: ratio must be in (0, 1), got {self.ratio}")
        if self.below is not None and self.below <= 0:
            raise InvalidUsageError(f"SlowReplicas: below (bytes/s) must be > 0, got {self.below}")
        if self.probe_bytes < 4096 or self.repeats < 1 or self.every < 0 or self.slow_step <= 1.0:
            raise InvalidUsageError(f"SlowReplicas: probe_bytes >= 4096, repeats >= 1, every >= 0 and "
                                    f"slow_step > 1 are needed, got {self}")


@dataclasses.dataclass(frozen=True)
class SlowMember:
    """A probe's verdict: ``rank`` of the group is slow; its score and the median's, bytes/s."""

    rank: int
    score: float
    median: float

    def describe(self, replica: str) -> str:
        return (f"{replica} (its best link {self.score / 1e6:.3g} MB/s, the median member's "
                f"{self.median / 1e6:.3g} MB/s)")


def pairings(size: int) -> List[List[int]]:
    """Rounds of a round-robin tournament (the circle method): ``rounds[r][member]`` is its
    partner in round ``r``, or -1 where it sits the round out (an odd count). Every pair meets
    once, and no member has more than one partner in a round."""
    slots = list(range(size)) + ([-1] if size % 2 else [])
    count = len(slots)
    rounds = []
    for _ in range(count - 1):
        partner = [-1] * size
        for k in range(count // 2):
            a, b = slots[k], slots[count - 1 - k]
            if a >= 0 and b >= 0:
                partner[a], partner[b] = b, a
        rounds.append(partner)
        slots = [slots[0], slots[-1], *slots[1:-1]]  # keep the first, turn the others
    return rounds


def probe_links(group, probe_bytes: int, repeats: int = 2) -> np.ndarray:
    """``rates[src, dst]``: the bytes/s ``dst`` received from ``src`` at best (see the module
    docstring); the same matrix on every member. The diagonal is 0."""
    size, rank = group.size, group.rank
    payload_out = np.zeros(probe_bytes, np.uint8)
    payload_in = np.empty(probe_bytes, np.uint8)
    go_out, ready_out = np.zeros(1, np.int64), np.zeros(1, np.int64)
    go_in, ready_in = np.empty(1, np.int64), np.empty(1, np.int64)
    received = np.zeros(size, np.float64)  # received[src]: from src, at best
    for _ in range(repeats):
        for partners in pairings(size):
            peer = partners[rank]
            if peer < 0:
                continue
            # First both partners are in the round: one that sat the last round out (or
            # finished it early) would otherwise start its clock while the other still works.
            ready = group.irecv(ready_in, peer, READY_TAG)
            group.isend(ready_out, peer, READY_TAG).wait()
            ready.wait()
            # The receiver paces its link: it posts its receive, tells the sender to go, and
            # times the payload from then. Data sent unasked would sit in the socket buffers
            # before anyone looks, and a fast link would time as nothing.
            payload_work = group.irecv(payload_in, peer, PROBE_TAG)
            asked = group.irecv(go_in, peer, GO_TAG)
            started = time.perf_counter()
            go_work = group.isend(go_out, peer, GO_TAG)
            asked.wait()
            send_work = group.isend(payload_out, peer, PROBE_TAG)
            payload_work.wait()
            seconds = max(time.perf_counter() - started, 1e-9)
            received[peer] = max(received[peer], probe_bytes / seconds)
            go_work.wait()
            send_work.wait()
    everyone = np.empty(size * size, np.float64)
    group.allgather(everyone, received)
    return everyone.reshape(size, size).T.copy()  # row: the receiver's measurements -> [src, dst]


def slowest_member(rates: np.ndarray, policy: SlowReplicas) -> Optional[SlowMember]:
    """The member the policy calls slow in a :func:`probe_links` matrix, or None."""
    size = rates.shape[0]
    if size < 3:
        return None  # a slow link between two members is both members' (see the module docstring)
    off = ~np.eye(size, dtype=bool)
    sending = np.array([rates[member][off[member]].max() for member in range(size)])
    receiving = np.array([rates[:, member][off[:, member]].max() for member in range(size)])
    scores: List[float] = list(np.minimum(sending, receiving))
    median = float(np.median(scores))
    worst = int(np.argmin(scores))
    score = float(scores[worst])
    if score >= policy.ratio * median or (policy.below is not None and score >= policy.below):
        return None
    return SlowMember(worst, score, median)
