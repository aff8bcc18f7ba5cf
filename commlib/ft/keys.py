"""Where the fault-tolerance protocol keeps its state in the coordinator's store, and the records.

Every key lives under ``ft/``. Values are small JSON records (never pickles: the store is shared
by every replica of the job). The keys, by who writes them:

* a replica: ``hb/<id>`` (its heartbeat record, rewritten every interval), ``live/<id>`` (an
  ephemeral key of its heartbeat connection: the server deletes it the moment that connection
  closes, so a process that dies is seen at once, without waiting out a timeout), ``slots`` and
  ``slot/<i>`` (registration: the coordinator learns the replica ids from them);
* the coordinator: ``q/<E>`` (the quorum record of epoch ``E``) and ``latest`` (the newest ``E``);
* either: ``e<E>/closed`` (the epoch ends: a member was lost, one joins, a member failed or was
  found slow, or the coordinator restarted), by ``compare_set`` where the first reason should stay;
* the members of epoch ``E``: their group's rendezvous under ``e<E>/pg``.

Steps never touch the store: their votes go over the members' group (:mod:`commlib.ft.manager`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import List, Optional

__all__ = ["ROOT", "heartbeat", "live", "SLOTS", "slot", "LATEST", "quorum", "closed", "group_prefix",
           "Heartbeat", "Quorum", "JOIN_PREFIX", "LOST_PREFIX", "SLOW_PREFIX", "WAITING", "TRAINING", "LEFT",
           "STRANDED"]

ROOT = "ft"
SLOTS = f"{ROOT}/slots"
LATEST = f"{ROOT}/latest"
#: Set by the coordinator (with the reason) when replicas wait behind the job's progress and no
#: replica that could still hold it is connected: the waiters can never catch up, and say so.
STRANDED = f"{ROOT}/stranded"

#: How a close for a joiner begins: the members finish their epoch at the end of the step in
#: progress (it commits as the epoch's last); any other reason ends it before the next step.
JOIN_PREFIX = "join: "
# The coordinator lost a member (connection closed, or no heartbeat): the epoch's collectives
# cannot finish, and its members abort their group at once (see Manager).
LOST_PREFIX = "lost "
#: The members found a member slow (see commlib.ft.links): ``slow <replica> (...)``. The step
#: before it committed; the coordinator keeps that replica out for its probation.
SLOW_PREFIX = "slow "
#: What a replica says it is doing.
WAITING, TRAINING, LEFT = "waiting", "training", "left"


def heartbeat(replica: str) -> str:
    return f"{ROOT}/hb/{replica}"


def live(replica: str) -> str:
    return f"{ROOT}/live/{replica}"


def slot(index: int) -> str:
    return f"{ROOT}/slot/{index}"


def quorum(epoch: int) -> str:
    return f"{ROOT}/q/{epoch}"


def closed(epoch: int) -> str:
    return f"{ROOT}/e{epoch}/closed"


def group_prefix(epoch: int) -> str:
    return f"{ROOT}/e{epoch}/pg"


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """A replica's heartbeat record: ``beat`` changes every interval (the coordinator times its
    changes on its own clock, so clocks of different hosts never meet); ``epoch`` is the last
    quorum epoch it trained in (-1: none yet); ``step`` how many steps it has committed."""

    beat: int
    state: str
    epoch: int
    step: int
    host: str = ""
    pid: int = 0

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Heartbeat":
        return cls(**json.loads(data))


@dataclasses.dataclass(frozen=True)
class Quorum:
    """The members of quorum epoch ``epoch`` (sorted replica ids: a member's rank in the
    cross-replica group is its index), and why the coordinator formed it."""

    epoch: int
    members: List[str]
    reason: str = ""

    def rank_of(self, replica: str) -> Optional[int]:
        return self.members.index(replica) if replica in self.members else None

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Quorum":
        return cls(**json.loads(data))
