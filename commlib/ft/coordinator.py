"""The coordinator: one small process that decides quorums, built on our TCP store.

    COMMLIB_JOB_SECRET_FILE=~/.secret python -m commlib.ft.coordinator --host 10.0.0.1 --port 29600

It serves a :class:`commlib.rendezvous.TCPStoreServer` (the engine: replicas keep their
heartbeats and the cross-replica groups' rendezvous there) and runs one decision loop
beside it that reads the heartbeats every ``tick`` and writes quorums. It decides only two
things: when the current epoch must end (``closed``: a member's heartbeat connection closed
(its process died: the store deletes its ephemeral ``live`` key at once), or its heartbeat
stopped changing for ``heartbeat_timeout`` (hung, or cut off), or a live replica waits to
join), and who the next epoch's members are (every live waiting replica, once the members of
the closed epoch have left it, except one on probation: its epoch's members found it slow
(``slow <replica>``, see :mod:`commlib.ft.links`); it is kept out for ``slow_probation`` seconds,
twice that the next time, up to 16 times, unless the quorum could not form without it).
Steps never come here: each is decided among its members, over their group (see
:mod:`commlib.ft.manager`).

Its state is soft: a restarted coordinator (same address, an empty store) listens for
``grace`` seconds, learns the replicas and their epochs from their heartbeats (they register
again when their connections break), closes the epochs they still train in (it does not know
their member sets; the members finish the step in progress), and numbers its first epoch
above every epoch a replica reports, so a quorum of the old instance can never be mistaken for
a new one (fencing by epoch).
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Dict, List, Optional

from commlib.errors import CommError
from commlib.ft import keys
from commlib.rendezvous.secret import JobSecret
from commlib.rendezvous.tcp_store import TCPStore
from commlib.rendezvous.tcp_store_server import TCPStoreServer

__all__ = ["Coordinator", "main"]

log = logging.getLogger("commlib.ft.coordinator")


class _Seen:
    __slots__ = ("record", "changed", "connected")

    def __init__(self, record: keys.Heartbeat, now: float):
        self.record, self.changed = record, now
        self.connected = True  # its heartbeat connection's ephemeral key exists


class Coordinator:
    """Serve the store on ``host:port`` and decide quorums (see the module docstring).

    ``initial_replicas``: the first quorum of a job (no replica has trained yet) waits for this
    many; later ones need ``min_replicas``. ``join_window``: a quorum is formed only once the
    set of waiting replicas stayed the same this long (replicas that start together join
    together). ``drain_timeout``: how long the members of a closed epoch may take to leave it
    (finish or discard their step) before the next quorum forms without them.
    ``slow_probation``: how long a replica found slow first waits before it may join again.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, secret: Optional[JobSecret] = None, *,
                 heartbeat_timeout: float = 0.8, min_replicas: int = 1, initial_replicas: int = 1,
                 join_window: float = 0.3, drain_timeout: float = 30.0, grace: Optional[float] = None,
                 tick: float = 0.02, slow_probation: float = 30.0):
        self.server = TCPStoreServer(host, port, secret)
        self.host, self.port = host, self.server.port
        self.secret = secret
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.min_replicas = max(1, int(min_replicas))
        self.initial_replicas = max(1, int(initial_replicas))
        self.join_window = float(join_window)
        self.drain_timeout = float(drain_timeout)
        self.grace = 2 * self.heartbeat_timeout if grace is None else float(grace)
        self.tick = float(tick)
        self.slow_probation = float(slow_probation)
        self.probation: Dict[str, float] = {}  # replica -> when it may join again (this clock)
        self.times_slow: Dict[str, int] = {}
        self.replicas: Dict[str, _Seen] = {}
        self.slots_read = 0
        self.current: Optional[keys.Quorum] = None
        self.closed_at: Optional[float] = None
        self.lost_marked = False
        self.restart_closed = False
        self.stranded = False  # keys.STRANDED was set: no replica can hold the job's state any more
        self.waiting_since = 0.0
        self.last_waiting: List[str] = []
        self.quorums: List[keys.Quorum] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store: Optional[TCPStore] = None

    @property
    def store(self) -> TCPStore:
        """The decision loop's own client of the store (for tools and tests that read its keys)."""
        assert self._store is not None, "open() or start() first"
        return self._store

    def describe(self) -> str:
        return f"coordinator tcp://{self.host}:{self.port}"

    def open(self) -> "Coordinator":
        """Serve the store, without the decision loop (:meth:`decide` is then called by hand)."""
        self.server.start()
        self._store = TCPStore(self.host, self.port, self.secret, timeout=10.0)
        self.started = time.monotonic()
        return self

    def start(self) -> "Coordinator":
        self.open()
        self._thread = threading.Thread(target=self._loop, name="commlib-ft-coordinator", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self.start()
        assert self._thread is not None
        while self._thread.is_alive():
            self._thread.join(0.5)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(10)
        if self._store is not None:
            self._store.close()
        self.server.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.decide(time.monotonic())
            except CommError as error:  # only if our own server is gone: nothing to decide then
                log.error("%s: %s", self.describe(), error)
                return
            self._stop.wait(self.tick)

    # -- one tick ------------------------------------------------------------------------------
    def _read_heartbeats(self, now: float) -> None:
        store = self._store
        assert store is not None
        slots = store.add(keys.SLOTS, 0)
        for index in range(self.slots_read, slots):
            replica = store.get(keys.slot(index), 5.0).decode()
            self.replicas.setdefault(replica, _Seen(keys.Heartbeat(-1, keys.WAITING, -1, 0), now))
        self.slots_read = slots
        if not self.replicas:
            return
        names = list(self.replicas)
        gone = set(store.missing([keys.live(name) for name in names]))
        for name in names:
            self.replicas[name].connected = keys.live(name) not in gone
        for replica, value in zip(names, store.multi_get([keys.heartbeat(name) for name in names], 5.0)):
            record = keys.Heartbeat.decode(value)
            seen = self.replicas[replica]
            if record != seen.record:
                seen.record, seen.changed = record, now

    def alive(self, now: float) -> Dict[str, keys.Heartbeat]:
        return {replica: seen.record for replica, seen in self.replicas.items()
                if seen.connected and now - seen.changed <= self.heartbeat_timeout and seen.record.state != keys.LEFT}

    def decide(self, now: float) -> None:
        self._read_heartbeats(now)
        alive = self.alive(now)
        store = self._store
        assert store is not None
        current = self.current
        if current is not None:
            self._close_if_needed(current, alive, store, now)
        if now - self.started < self.grace:
            return  # a restarted coordinator first hears every live replica out
        if current is None and not self.restart_closed:
            self._close_epochs_of_before(alive, store, now)
        if current is not None and self.closed_at is None:
            return
        waiting = sorted(replica for replica, record in alive.items() if record.state == keys.WAITING)
        first = current is None and all(record.epoch < 0 for record in alive.values())
        needed = self.initial_replicas if first else self.min_replicas
        eligible = [replica for replica in waiting if not self._on_probation(replica, now)]
        if len(eligible) >= needed:
            waiting = eligible  # else a slow replica is better than no quorum
        if waiting != self.last_waiting:
            self.last_waiting, self.waiting_since = waiting, now
        if self.closed_at is not None and now - self.closed_at < self.drain_timeout:
            draining = [replica for replica, record in alive.items() if record.state == keys.TRAINING
                        and (current is None or (replica in current.members and record.epoch <= current.epoch))]
            if draining:
                return
        # A quorum that would start behind the job (every trained replica left) would train from
        # scratch as if nothing had happened: it waits for a replica that holds the job's state,
        # or is told that none can. (A member that exited does not count: a step only it
        # committed is redone by the others, who could not know whether it committed.)
        progress = max([record.step for record in alive.values()]
                       + [seen.record.step for seen in self.replicas.values() if seen.record.state == keys.LEFT],
                       default=0)
        if waiting and max(alive[replica].step for replica in waiting) < progress:
            self._strand_if_nobody_holds(progress, store)
            return
        if len(waiting) < needed:
            return
        if now - self.waiting_since < self.join_window:
            return
        reported = max([record.epoch for record in alive.values()] + [current.epoch if current else -1])
        epoch = reported + 1
        reason = "first quorum" if first else (f"after epoch {current.epoch}" if current else "coordinator restarted")
        out = [replica for replica in alive if self._on_probation(replica, now) and replica not in waiting]
        if out:
            reason += "; on probation: " + ", ".join(
                f"{replica} for {self.probation[replica] - now:.1f} s more" for replica in sorted(out))
        quorum = keys.Quorum(epoch, waiting, reason)
        store.set(keys.quorum(epoch), quorum.encode())
        store.set(keys.LATEST, str(epoch))
        self.current, self.closed_at, self.lost_marked = quorum, None, False
        self.quorums.append(quorum)
        log.info("epoch %d: members %s (%s)", epoch, ",".join(waiting), reason)

    def _strand_if_nobody_holds(self, progress: int, store: TCPStore) -> None:
        """Waiters are behind the job's ``progress`` (which replicas that left hold): if no
        replica that could still hold it is connected, tell the waiters that they can never
        catch up, instead of letting them wait to their join timeout. A replica that is
        connected but silent (cut off: its connection stays open) may come back."""
        if self.stranded:
            return
        if any(seen.connected and seen.record.state != keys.LEFT and seen.record.step >= progress
               for seen in self.replicas.values()):
            return
        trained = sorted(name for name, seen in self.replicas.items() if seen.record.step >= progress)
        reason = (f"no live replica holds the job's state: the job is at step {progress}, and the replicas that "
                  f"trained it ({', '.join(trained)}) have left or exited; a replica cannot catch up from disk")
        store.set(keys.STRANDED, reason)
        self.stranded = True
        log.warning("%s", reason)

    def _on_probation(self, replica: str, now: float) -> bool:
        return self.probation.get(replica, 0.0) > now

    def _put_on_probation(self, reason: str, now: float) -> None:
        """``reason`` is a close for a slow member (``slow <replica> (...)``): keep it out."""
        replica = reason[len(keys.SLOW_PREFIX):].split(" ", 1)[0]
        if replica not in self.replicas:
            return
        times = self.times_slow.get(replica, 0)
        self.times_slow[replica] = times + 1
        seconds = self.slow_probation * 2 ** min(times, 4)
        self.probation[replica] = now + seconds
        log.info("%s is slow; on probation for %g s", replica, seconds)

    def _close_epochs_of_before(self, alive: Dict[str, keys.Heartbeat], store: TCPStore, now: float) -> None:
        """A restarted coordinator ends the epochs its replicas still train in (it does not know
        their member sets), so that the next quorum is its own; their steps are not redone."""
        self.restart_closed = True
        epochs = sorted({record.epoch for record in alive.values() if record.state == keys.TRAINING})
        for epoch in epochs:
            store.compare_set(keys.closed(epoch), "", "coordinator restarted")
            log.info("epoch %d closed: coordinator restarted", epoch)
        if epochs:
            self.closed_at = now

    def _close_if_needed(self, current: keys.Quorum, alive: Dict[str, keys.Heartbeat], store: TCPStore,
                         now: float) -> None:
        """End ``current`` when a member is lost (overriding a close for a joiner: the members then
        leave before their next step), or when a replica waits to join."""
        epoch = current.epoch
        lost = [replica for replica in current.members if replica not in alive]
        if lost and not self.lost_marked:
            how = {replica: ("its connection closed" if not self.replicas[replica].connected
                             else f"no heartbeat for {self.heartbeat_timeout:g} s") for replica in lost}
            reason = keys.LOST_PREFIX + ", ".join(f"{replica} ({why})" for replica, why in how.items())
            store.set(keys.closed(epoch), reason)
            self.lost_marked = True
        elif self.closed_at is None:
            joining = sorted(replica for replica, record in alive.items() if replica not in current.members
                             and record.state == keys.WAITING and not self._on_probation(replica, now))
            if store.check([keys.closed(epoch)]):
                said = store.get(keys.closed(epoch), 5.0).decode()
                reason = f"closed by a member: {said}"
                if said.startswith(keys.SLOW_PREFIX):
                    self._put_on_probation(said, now)
            elif joining:
                reason = keys.JOIN_PREFIX + ",".join(joining)
                store.compare_set(keys.closed(epoch), "", reason)
            else:
                return
        else:
            return
        if self.closed_at is None:
            self.closed_at = now
        log.info("epoch %d closed: %s", epoch, reason)


def main(argv=None) -> None:
    from commlib.config import load_config
    from commlib.rendezvous.secret import configured_secret

    parser = argparse.ArgumentParser(description="commlib's fault-tolerance coordinator (quorums over a TCP store)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=29600)
    parser.add_argument("--open", action="store_true", help="run without a job secret (trusts the network)")
    parser.add_argument("--heartbeat-timeout", type=float, default=0.8)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--initial-replicas", type=int, default=1)
    parser.add_argument("--join-window", type=float, default=0.3)
    parser.add_argument("--drain-timeout", type=float, default=30.0)
    parser.add_argument("--grace", type=float, default=None, help="seconds a (re)started coordinator listens first")
    parser.add_argument("--slow-probation", type=float, default=30.0,
                        help="seconds a replica found slow waits before it may join again (doubled each time)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    secret = configured_secret(load_config())
    if secret is None and not args.open:
        parser.error("no job secret: set COMMLIB_JOB_SECRET or COMMLIB_JOB_SECRET_FILE, or pass --open")
    coordinator = Coordinator(args.host, args.port, secret, heartbeat_timeout=args.heartbeat_timeout,
                              min_replicas=args.min_replicas, initial_replicas=args.initial_replicas,
                              join_window=args.join_window, drain_timeout=args.drain_timeout, grace=args.grace,
                              slow_probation=args.slow_probation)
    log.info("serving %s", coordinator.describe())
    try:
        coordinator.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        coordinator.close()


if __name__ == "__main__":
    main()
