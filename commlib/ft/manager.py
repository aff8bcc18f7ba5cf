"""``Manager``: one replica's side of fault-tolerant data parallelism.

A replica trains in *quorum epochs*. An epoch ``E`` is a member set the coordinator published
(:mod:`commlib.ft.coordinator`); its members build a cross-replica group over sockets under a
store prefix of their own (``ft/e<E>/pg``, so no message of an earlier group can reach it),
catch up from the most advanced member (:mod:`commlib.ft.catchup`), then run steps until the
epoch ends. A step:

1. the gradients are averaged over the members (:meth:`Manager.allreduce_average`); an error
   (a peer exited, a timeout) is kept, not raised;
2. :meth:`Manager.should_commit` votes: one more allreduce, of two integers per member (did my
   allreduce fail; has the coordinator closed the epoch). A member that completes the vote holds
   every member's ballot, so it knows that every member finished its gradient allreduce (or
   said it failed): it commits when no ballot says failed, discards otherwise, and all members
   that complete the vote decide alike. The coordinator is not on a step's path at all.
3. commit: the optimizer steps and the ledger moves the data position on. Discard: nothing is
   applied, the epoch is left, and the step is redone by the next quorum (with the survivors:
   the lost replica's samples are theirs now). Commit-last: applied, and the epoch ends there
   (a replica is joining: it then catches up; no step is redone for it).

A member whose vote fails (a peer died during it) cannot know what the others decided: it
applies nothing and counts itself *behind*. It leaves the epoch (which then ends for everyone at
their next step), and if another member did commit, the catch-up of the next quorum brings that
state here; if none did, all redo the step. No member ever applies a partial average.

A member that is slow (its host's network turned slow, yet it heartbeats) is found by link
probes when the manager has a :class:`commlib.ft.links.SlowReplicas` policy: the members end
the epoch after a committed step with ``slow <replica>``, and the coordinator keeps it out for a
probation (see :mod:`commlib.ft.links`).

A member that is cut off (a host whose network went down) sends nothing, not even a close, so
the others' collectives would wait for it until the group's timeout. The coordinator sees its
heartbeats stop and closes the epoch with a ``lost`` reason; each member's heartbeat thread
reads that within a beat and aborts the group (:meth:`commlib.ProcessGroup.abort`): the step in
progress fails at once everywhere and is redone by the next quorum, without the lost member.

**Replica groups of several ranks** (``local_group``: the replica's own ranks, e.g. the ranks of
one host's mpiexec job, every replica with as many): the replica is the unit of membership and
of failure, as in HSDP. Its local rank 0 (the *leader*) alone heartbeats and reads quorums, and
hands each decision to the others over the local group (the quorum to enter, whether the epoch
is lost before a step); local rank ``j`` of every member averages over its own cross-replica
group, the ``j``-th (``ft/e<E>/pg/<j>``), and catches up from local rank ``j`` of the source, so
each rank's shard of the state (a sharded or tensor-parallel model) comes from its counterpart.
A step's outcome is each cross group's vote, then the worst of them over the local group
(commit < commit-last < discard < unknown): every member holds the outcomes of the same cross
groups, so all decide alike, and the ranks of one replica never apply different steps. A
replica whose ranks did not all enter an epoch closes it (all leave at the next step).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from commlib.config import load_config
from commlib.errors import CommError, CommTimeoutError, InvalidUsageError, JobStateLostError
from commlib.ft import keys
from commlib.ft.catchup import CatchUp, Payload, broadcast_small, catch_up
from commlib.ft.heartbeat import HeartbeatThread
from commlib.ft.links import SlowReplicas, probe_links, slowest_member
from commlib.ft.sampling import Ledger, share_weight, shares
from commlib.ops import ReduceOp
from commlib.rendezvous.secret import JobSecret
from commlib.rendezvous.tcp_store import TCPStore
from commlib.runtime import group_over_store

if TYPE_CHECKING:
    from commlib.group.process_group import ProcessGroup

__all__ = ["Manager", "finish_average", "COMMIT", "COMMIT_LAST", "ABORT"]

#: How often a replica waiting for a quorum asks whether the job's state is lost (keys.STRANDED).
STRANDED_CHECK_SECONDS = 0.2
#: How many of an epoch's latest gradient allreduces the slow-step trigger takes the median of.
SLOW_STEP_WINDOW = 64
#: A step's outcomes: committed (the epoch goes on), committed and the epoch's last, discarded.
COMMIT, COMMIT_LAST, ABORT = "commit", "commit-last", "abort"
# From best to worst (None: the vote failed, the outcome is unknown here): a replica of several
# ranks takes its ranks' worst.
_OUTCOMES: List[Optional[str]] = [COMMIT, COMMIT_LAST, ABORT, None]
#: How long at most the leader of a replica of several ranks searches for a quorum before it
#: tells the others that it still waits.
LEADER_SLICE_SECONDS = 1.0


class _NotEverywhere(CommError):
    """Another rank of this replica could not enter the epoch (this one did)."""


def finish_average(flat: np.ndarray, members: int) -> None:
    """The sum over ``members`` becomes their mean, in place (what a reference replay does too)."""
    if members > 1:
        np.divide(flat, flat.dtype.type(members), out=flat)


def _address(coordinator: str) -> Tuple[str, int]:
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidUsageError(f"Manager: coordinator must be HOST:PORT, got {coordinator!r}")
    return host.strip("[]"), int(port)


class Manager:
    """This replica's membership, steps and state (see the module docstring).

    ``coordinator``: ``HOST:PORT`` of ``python -m commlib.ft.coordinator``; ``replica_id``: unique
    in the job and stable across restarts of the replica (default: host name and pid).
    ``timeout`` bounds each collective of a cross-replica group (a peer that stops answering
    without exiting is found by it; one that exits, within a second) and building one;
    ``connect_timeout`` how long a replica waits for a (restarted) coordinator.
    ``algorithm``: the allreduce of the gradients (a fixed one, so a replay of the same member
    sets is bitwise the same; ring by default). ``slow_replicas``: probe the members' links and
    exclude a slow one (off by default; see :mod:`commlib.ft.links`). ``local_group``: the ranks
    of this replica (every one of them makes a Manager with the same ``replica_id``, at the same
    point, and calls the same steps; see "Replica groups" above). The link probe works on
    replicas of one rank only, for now.
    """

    def __init__(self, coordinator: str, replica_id: Optional[str] = None, *, secret: Optional[JobSecret] = None,
                 heartbeat_interval: float = 0.1, timeout: float = 60.0,
                 connect_timeout: float = 120.0, join_timeout: float = 600.0, algorithm: str = "ring",
                 slow_replicas: Optional[SlowReplicas] = None, local_group: Optional["ProcessGroup"] = None):
        self.host, self.port = _address(coordinator)
        self.replica_id = replica_id or f"{socket.gethostname()}-{os.getpid()}"
        if "/" in self.replica_id or not self.replica_id:
            raise InvalidUsageError(f"Manager: replica_id must be a non-empty name without '/', got {replica_id!r}")
        self.secret = secret
        self.timeout = float(timeout)
        self.connect_timeout, self.join_timeout = float(connect_timeout), float(join_timeout)
        self.algorithm = algorithm
        if slow_replicas is not None and not isinstance(slow_replicas, SlowReplicas):
            raise InvalidUsageError(f"Manager: slow_replicas must be a SlowReplicas, got "
                                    f"{type(slow_replicas).__name__}")
        self.slow_replicas = slow_replicas
        self.local_group = local_group if local_group is not None and local_group.size > 1 else None
        self.local_rank = self.local_group.rank if self.local_group is not None else 0
        self.local_size = self.local_group.size if self.local_group is not None else 1
        if self.local_group is not None and slow_replicas is not None:
            raise InvalidUsageError(f"Manager: slow_replicas with a local_group of {self.local_size} ranks: the link "
                                    f"probe measures replicas of one rank only")
        # This epoch's latest gradient allreduces (the slow-step trigger): a window, so that the
        # median each step costs the same however long the epoch runs.
        self._allreduce_seconds: Deque[float] = collections.deque(maxlen=SLOW_STEP_WINDOW)
        # Replicas stand for hosts: their group talks over sockets only, and a killed replica
        # leaves no shared memory behind.
        self.group_config = dataclasses.replace(load_config(), shm=False, crash_witness=False)
        self.ledger = Ledger()
        self.states: Dict[str, Tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.codec: Any = None
        self.gradient_hooks: List[Callable[[], None]] = []
        # Called with a chunk's index each time this replica, the source of a catch-up, has
        # sent one (a test's fault point: a source killed while a joiner takes its state).
        self.catch_up_hooks: List[Callable[[int], None]] = []
        self.events: List[dict] = []
        self.group: Optional[ProcessGroup] = None
        self.quorum: Optional[keys.Quorum] = None
        self.epoch = -1
        self.step_open = False
        self.failure: Optional[BaseException] = None
        self.last_catch_up: Optional[CatchUp] = None
        self.last_committed = False
        self._latest_seen = -1
        self._beat_state: Tuple[str, int, int] = (keys.WAITING, -1, 0)
        self._store = self._connect(self.connect_timeout)
        self.heartbeat = HeartbeatThread(self.replica_id, lambda: self._connect(1.0), lambda: self._beat_state,
                                         heartbeat_interval, beats=self.local_rank == 0)
        self.heartbeat.on_change = self._on_close_seen
        self.heartbeat.start()

    # -- what users read -----------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps committed so far (the job's step number)."""
        return len(self.ledger.steps)

    @property
    def members(self) -> List[str]:
        return list(self.quorum.members) if self.quorum is not None else []

    @property
    def rank(self) -> int:
        """This replica's rank in the current quorum (starts the step first)."""
        self.start_step()
        assert self.quorum is not None
        rank = self.quorum.rank_of(self.replica_id)
        assert rank is not None
        return rank

    def summary(self) -> dict:
        return self.ledger.summary()

    def save_events(self, path: str) -> None:
        """Write :attr:`events` as JSON, the input of ``python -m commlib.ft.timeline``."""
        with open(path, "w") as handle:
            json.dump({"replica": self.replica_id, "events": self.events}, handle)

    @property
    def store(self) -> TCPStore:
        """This replica's connection to the coordinator's store (the main thread's; it changes
        when the coordinator restarts). Other groups may meet through it under prefixes outside ``ft/``."""
        return self._store

    # -- state and data ------------------------------------------------------------------------
    def register_state(self, name: str, save: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """State a joiner receives: ``save()`` on the source, ``load(obj)`` on the joiner (objects
        pass through :attr:`codec`: an ``encode(obj) -> bytes`` / ``decode(bytes)`` pair)."""
        if name in self.states:
            raise InvalidUsageError(f"Manager.register_state: {name!r} is registered already")
        self.states[name] = (save, load)

    def configure_data(self, dataset_size: int, batch_size: int, seed: int = 0) -> None:
        """Sample accounting over ``dataset_size`` samples, ``batch_size`` per replica per step
        (a joiner's settings come from its source with the data position)."""
        if dataset_size < 1 or batch_size < 1:
            raise InvalidUsageError(f"Manager.configure_data: dataset_size {dataset_size} and batch_size "
                                    f"{batch_size} must be >= 1")
        if not self.ledger.configured:
            self.ledger.dataset_size, self.ledger.batch_size, self.ledger.seed = dataset_size, batch_size, seed

    def batch_indices(self) -> np.ndarray:
        """This replica's sample indices for the step in progress (see :mod:`commlib.ft.sampling`)."""
        self.start_step()
        return self.ledger.indices(self.rank, len(self.members))

    def local_batch_indices(self) -> np.ndarray:
        """This rank's part of the replica's share (a replica of several ranks that trains data
        parallel inside: its ranks split the share in rank order, sizes differing by at most one,
        maybe empty); the whole share for a replica of one rank."""
        indices = self.batch_indices()
        part = shares(len(indices), self.local_size)[self.local_rank]
        return indices[part.start:part.stop]

    def average_over_replica(self, flat: np.ndarray) -> None:
        """``flat``, this rank's mean gradient over its :meth:`local_batch_indices` (zeros for an
        empty part), becomes the replica's mean over its whole share, on every rank of it (each
        weighted by its part, summed over the local group with the manager's fixed algorithm);
        nothing for a replica of one rank. Then :meth:`allreduce_average` averages it across
        replicas. A failure here is the replica's own (its group is its ranks): it is raised."""
        self.start_step()
        if self.local_group is None:
            return
        if not self.ledger.configured:  # without sample accounting: the plain mean of the ranks
            self.replica_mean(flat, 1, self.local_size)
            return
        share = self._share_size()
        self.replica_mean(flat, len(shares(share, self.local_size)[self.local_rank]), share)

    def replica_mean(self, flat: np.ndarray, part: int, whole: int) -> None:
        """``flat``, this rank's mean gradient over ``part`` of a batch of ``whole`` samples split
        over the replica's ranks (:func:`~commlib.ft.sampling.shares`, in rank order), becomes the
        mean over the whole batch on every rank of the replica: weighted by ``part``, summed over
        the local group with the manager's fixed algorithm (the bits a replay gets). Nothing for a
        replica of one rank. A failure is the replica's own: it is raised."""
        if self.local_group is None:
            return
        weight = share_weight(part, whole, self.local_size) if whole else 0.0
        if weight != 1.0:
            np.multiply(flat, flat.dtype.type(weight), out=flat)
        self.local_group.allreduce(flat, algorithm=self.algorithm)
        finish_average(flat, self.local_size)

    def gradient_weight(self) -> float:
        """What this replica's mean gradient is scaled by before the average (1.0: equal shares)."""
        self.start_step()
        if not self.ledger.configured:
            return 1.0
        return share_weight(self._share_size(), self.ledger.plan(len(self.members)), len(self.members))

    def _share_size(self) -> int:
        """How many samples this replica's share of the step in progress holds (no permutation drawn)."""
        members = len(self.members)
        return len(shares(self.ledger.plan(members), members)[self.rank])

    def optimizer(self, optim):
        """``optim`` wrapped: ``zero_grad`` starts a step, ``step`` commits it or discards it."""
        from commlib.ft.optimizer import OptimizerWrapper

        return OptimizerWrapper(self, optim)

    # -- a step --------------------------------------------------------------------------------
    def start_step(self) -> None:
        """Join a quorum if this replica has none, and open the next step. Idempotent within a step."""
        if self.step_open:
            return
        while True:
            while self.group is None:
                self._join_quorum()
            if not self._epoch_lost():
                break
        self.step_open = True
        self.failure = None
        self._beat_state = (keys.TRAINING, self.epoch, self.steps)

    def allreduce_average(self, flat: np.ndarray, weight: float = 1.0) -> None:
        """``flat`` (in place) becomes the members' (weighted) mean; a failure is kept for
        :meth:`should_commit`, never raised (the step is then discarded everywhere)."""
        self.start_step()
        if self.failure is not None:
            return
        if weight != 1.0:
            np.multiply(flat, flat.dtype.type(weight), out=flat)
        group = self.group
        assert group is not None
        try:
            started = time.perf_counter()
            if group.size > 1:
                group.allreduce(flat, algorithm=self.algorithm)
            self._allreduce_seconds.append(time.perf_counter() - started)
            finish_average(flat, group.size)
        except CommError as error:
            self.failure = error
            self._event("allreduce-failed", error=str(error)[:300])

    def should_commit(self) -> bool:
        """Whether the step commits (see the module docstring); after it, the step is closed."""
        if not self.step_open:
            raise InvalidUsageError("Manager.should_commit: no step is open (call start_step first)")
        for hook in self.gradient_hooks:
            hook()
        epoch, step, members, group = self.epoch, self.steps, self.members, self.group
        assert group is not None
        closing = bool(self.heartbeat.watched(keys.closed(epoch)))
        ballot = np.array([self.failure is not None, closing, self._wants_probe()], np.int64)
        result: Optional[str] = None
        try:
            if group.size > 1:
                group.allreduce(ballot, algorithm=self.algorithm)
            result = ABORT if ballot[0] else COMMIT_LAST if ballot[1] else COMMIT
        except CommError as error:
            self._event("vote-failed", step=step, error=str(error)[:300])
        if self.local_group is not None:
            result = self._worst_over_replica(result)
        self.step_open = False
        committed = result in (COMMIT, COMMIT_LAST)
        if committed:
            record = self.ledger.commit(epoch, members)
            self._event("commit", step=record.step, members=members, global_batch=record.global_batch,
                        last=result == COMMIT_LAST)
        else:
            self._event("abort" if result else "outcome-unknown", step=step, members=members)
        if result == COMMIT and ballot[2]:
            reason = self._probe(group, epoch, members)
            if reason is not None:  # the step stands; the epoch ends after it
                self._close_epoch(epoch, reason)
                result = COMMIT_LAST
        if result != COMMIT:
            if result != COMMIT_LAST:
                self._close_epoch(epoch, f"{self.replica_id}: step {step} {'discarded' if result else 'undecided'}: "
                                         f"{self.failure}")
            self._leave_epoch()
        self._beat_state = (keys.TRAINING if self.group is not None else keys.WAITING, self.epoch, self.steps)
        self.last_committed = committed
        return committed

    def close(self) -> None:
        """Leave the job: the coordinator drops this replica at once (no heartbeat timeout).
        (A replica of several ranks: every rank calls it; the leader's says so.)"""
        self._beat_state = (keys.LEFT, self.epoch, self.steps)
        self.heartbeat.stop(final_state=keys.LEFT)
        self._leave_epoch()
        self._store.close()

    # -- inside --------------------------------------------------------------------------------
    def _connect(self, connect_timeout: float) -> TCPStore:
        """A store connection, retried until ``connect_timeout``: a coordinator that is starting
        (or going) may accept a connection and reset it during the handshake."""
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                return TCPStore(self.host, self.port, self.secret, timeout=max(self.timeout, 10.0),
                                connect_timeout=max(0.1, deadline - time.monotonic()))
            except CommError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _store_lost(self, error: BaseException) -> None:
        self._event("coordinator-lost", error=str(error)[:300])
        self._store.close()
        self._store = self._connect(self.connect_timeout)
        self._latest_seen = -1  # a restarted coordinator numbers its epochs above ours, from its own store

    def _event(self, kind: str, **details) -> None:
        self.events.append({"t": time.time(), "kind": kind, "replica": self.replica_id, "epoch": self.epoch,
                            **details})

    def _close_epoch(self, epoch: int, reason: str) -> None:
        """Tell the coordinator that ``epoch`` is over (the first reason stays)."""
        try:
            self._store.compare_set(keys.closed(epoch), "", reason[:500])
        except CommError as error:
            self._store_lost(error)

    def _on_close_seen(self, key: str, reason: str) -> None:
        """On the heartbeat thread: the coordinator lost a member of this epoch. Its collectives
        cannot finish (a member cut off from the network sends no close, and would hold them to
        the group's timeout): abort the group now, so the step fails and is redone without it."""
        group = self.group
        if group is not None and reason.startswith(keys.LOST_PREFIX) and key == keys.closed(self.epoch):
            self._event("group-aborted", reason=reason)
            try:
                group.abort(f"epoch {self.epoch} closed by the coordinator: {reason}")
            except Exception as error:  # noqa: BLE001 - the heartbeat must go on; the step then fails at its timeout
                self._event("abort-failed", error=f"{type(error).__name__}: {error}"[:300])

    def _wants_probe(self) -> bool:
        """This member's ballot for a link probe after the step (see :mod:`commlib.ft.links`)."""
        policy = self.slow_replicas
        if policy is None or len(self.members) < 3:
            return False
        if policy.every and (self.steps + 1) % policy.every == 0:
            return True
        seconds = list(self._allreduce_seconds)
        return len(seconds) > 5 and seconds[-1] > policy.slow_step * float(np.median(seconds[:-1]))

    def _probe(self, group, epoch: int, members: List[str]) -> Optional[str]:
        """Probe the members' links; the reason to end the epoch (a member is slow, or the probe
        failed), or None. Every member gets the same matrix, so all decide alike."""
        policy = self.slow_replicas
        assert policy is not None
        self._allreduce_seconds.clear()  # the trigger waits for new steps after a probe
        started = time.perf_counter()
        try:
            rates = probe_links(group, policy.probe_bytes, policy.repeats)
        except CommError as error:
            self._event("probe-failed", epoch=epoch, error=str(error)[:300])
            return f"{self.replica_id}: link probe failed: {error}"
        slow = slowest_member(rates, policy)
        self._event("probe", epoch=epoch, members=members, seconds=time.perf_counter() - started,
                    rates_mb_s=np.round(rates / 1e6, 3).tolist(), slow=members[slow.rank] if slow else None)
        if slow is None:
            return None
        return keys.SLOW_PREFIX + slow.describe(members[slow.rank])

    def _epoch_lost(self) -> bool:
        """Before a step: leave an epoch that is closed for any reason but a joiner (a member was
        lost: its allreduce could only fail; or the coordinator restarted)."""
        reason = self.heartbeat.watched(keys.closed(self.epoch))
        if self.local_group is not None:  # the leader's reading, so that the replica's ranks leave together
            reason = self._from_leader({"reason": reason})["reason"]
        if not reason or reason.startswith(keys.JOIN_PREFIX):
            return False
        self._event("epoch-closed", step=self.steps, reason=reason)
        self._leave_epoch()
        return True

    def _leave_epoch(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            try:
                group.close()
            except CommError:
                pass
        self._beat_state = (keys.WAITING, self.epoch, self.steps)

    def _join_quorum(self) -> None:
        deadline = time.monotonic() + self.join_timeout
        self._beat_state = (keys.WAITING, self.epoch, self.steps)
        while True:
            quorum = self._next_quorum(deadline)
            rank = quorum.rank_of(self.replica_id)
            assert rank is not None
            if self._enter(quorum, rank):
                return

    def _next_quorum(self, deadline: float) -> keys.Quorum:
        """The next quorum with this replica in it. A replica of several ranks: the leader's,
        handed to the others at least every ``LEADER_SLICE_SECONDS`` (a "still waiting" record
        meanwhile, so their local collective never waits out its timeout; an error the leader
        raises, they raise too)."""
        if self.local_group is None:
            quorum = self._search_quorum(deadline, deadline)
            if quorum is None:
                raise self._no_quorum()
            return quorum
        while True:
            record: Dict[str, Any] = {}
            if self.local_rank == 0:
                try:
                    quorum = self._search_quorum(deadline, time.monotonic() + LEADER_SLICE_SECONDS)
                    if quorum is not None:
                        record = {"quorum": dataclasses.asdict(quorum)}
                    elif time.monotonic() >= deadline:
                        raise self._no_quorum()
                except (JobStateLostError, CommTimeoutError) as error:
                    self._from_leader({"error": type(error).__name__, "message": str(error)})
                    raise
            record = self._from_leader(record)
            if "error" in record:
                kind = JobStateLostError if record["error"] == "JobStateLostError" else CommTimeoutError
                raise kind(f"{record['message']} (local rank {self.local_rank} of replica {self.replica_id}: "
                           f"as its local rank 0 said)")
            if "quorum" in record:
                return keys.Quorum(**record["quorum"])

    def _no_quorum(self) -> CommTimeoutError:
        return CommTimeoutError(f"replica {self.replica_id}: no quorum took it within {self.join_timeout:g} s "
                                f"(coordinator {self.host}:{self.port})")

    def _search_quorum(self, deadline: float, until: float) -> Optional[keys.Quorum]:
        """Read the coordinator's quorums until one takes this replica (None at ``until``)."""
        next_stranded_check = time.monotonic()
        while time.monotonic() < min(deadline, until):
            try:
                if time.monotonic() >= next_stranded_check:
                    next_stranded_check = time.monotonic() + STRANDED_CHECK_SECONDS
                    self._raise_if_stranded()
                latest = int(self._store.get(keys.LATEST, 0.2))
                if latest <= self._latest_seen:
                    time.sleep(0.02)
                    continue
                self._latest_seen = latest
                quorum = keys.Quorum.decode(self._store.get(keys.quorum(latest), 5.0))
            except JobStateLostError:
                raise
            except CommTimeoutError:
                continue
            except CommError as error:
                self._store_lost(error)
                continue
            if quorum.rank_of(self.replica_id) is not None:
                return quorum
        return None

    def _from_leader(self, record: Dict[str, Any]) -> Dict[str, Any]:
        """Local rank 0's ``record`` on every rank of the replica (a small JSON broadcast)."""
        assert self.local_group is not None
        data = json.dumps(record).encode() if self.local_rank == 0 else None
        return json.loads(broadcast_small(self.local_group, data, 0))

    def _worst_over_replica(self, result: Optional[str]) -> Optional[str]:
        """The worst of the local ranks' step outcomes (see "Replica groups" above)."""
        assert self.local_group is not None
        code = np.array([_OUTCOMES.index(result)], np.int64)
        self.local_group.allreduce(code, op=ReduceOp.MAX)
        return _OUTCOMES[int(code[0])]

    def _raise_if_stranded(self) -> None:
        """The coordinator found that no live replica holds the job's state: this replica, behind
        it, can never catch up (there is no catch-up from disk)."""
        if not self._store.missing([keys.STRANDED]):
            reason = self._store.get(keys.STRANDED, 5.0).decode()
            self._event("stranded", reason=reason)
            raise JobStateLostError(f"replica {self.replica_id} (at step {self.steps}): {reason} "
                                    f"(coordinator {self.host}:{self.port})")

    def _enter(self, quorum: keys.Quorum, rank: int) -> bool:
        started = time.perf_counter()
        group = None
        try:
            prefix, name = keys.group_prefix(quorum.epoch), f"ft-e{quorum.epoch}"
            if self.local_group is not None:  # local rank j's cross-replica group
                prefix, name = f"{prefix}/{self.local_rank}", f"{name}-l{self.local_rank}"
            group = group_over_store(self._store, rank, len(quorum.members), timeout=self.timeout,
                                     name=name, prefix=prefix, config=self.group_config)
            if self.slow_replicas is not None and len(quorum.members) >= 3:
                # Before the catch-up: a joiner that is still slow goes back without a transfer.
                reason = self._probe(group, quorum.epoch, quorum.members)
                if reason is not None:
                    group.close()
                    self._close_epoch(quorum.epoch, reason)
                    return False
            self.last_catch_up = catch_up(group, self.steps, self._save, self._load, chunk_sent=self._chunk_sent)
            self._entered_everywhere(quorum.epoch, ok=True)
        except CommError as error:
            self._event("enter-failed", joining=quorum.epoch, error=str(error)[:300])
            if group is not None:
                group.close()
            try:
                self._store.compare_set(keys.closed(quorum.epoch), "",
                                        f"{self.replica_id} could not enter: {error}"[:500])
            except CommError as lost:
                self._store_lost(lost)
            if not isinstance(error, _NotEverywhere):
                self._entered_everywhere(quorum.epoch, ok=False)
            return False
        self.group, self.quorum, self.epoch = group, quorum, quorum.epoch
        self._allreduce_seconds.clear()
        self.heartbeat.watch(keys.closed(quorum.epoch))
        self._event("quorum", members=quorum.members, rank=rank, reason=quorum.reason,
                    setup_s=time.perf_counter() - started, catch_up_bytes=self.last_catch_up.nbytes,
                    catch_up_s=self.last_catch_up.seconds, transfer_s=self.last_catch_up.transfer_seconds,
                    behind=self.last_catch_up.behind)
        return True

    def _entered_everywhere(self, epoch: int, ok: bool) -> None:
        """A replica of several ranks: whether all its ranks entered ``epoch`` (every rank asks
        once per attempt, having entered or not); raises :class:`_NotEverywhere` where one did not."""
        if self.local_group is None:
            return
        entered = np.array([int(ok)], np.int64)
        self.local_group.allreduce(entered, op=ReduceOp.MIN)
        if ok and not entered[0]:
            raise _NotEverywhere(f"replica {self.replica_id}: another of its ranks could not enter epoch {epoch}")

    def _chunk_sent(self, index: int) -> None:
        for hook in self.catch_up_hooks:
            hook(index)

    def _save(self) -> Tuple[dict, Payload]:
        payload: Payload = b""
        if self.states:
            if self.codec is None:
                raise InvalidUsageError("Manager: states are registered but no codec encodes them")
            payload = self.codec.encode({name: save() for name, (save, _) in self.states.items()})
        return self.ledger.to_json(), payload

    def _load(self, ledger: dict, payload: Payload) -> None:
        self.ledger = Ledger.from_json(ledger)
        if payload:
            objects = self.codec.decode(payload)
            for name, (_, load) in self.states.items():
                load(objects[name])
        self._event("caught-up", steps=self.steps, bytes=memoryview(payload).nbytes)
