"""commlib.ft in one process: the store's ephemeral keys, the sample ledger, and the coordinator's
decisions, driven tick by tick (``decide(now)`` with a chosen clock) against a real store server
whose heartbeats test clients write as replicas would."""

from __future__ import annotations

import time

import numpy as np
import pytest

from commlib.ft import Ledger, keys
from commlib.ft.coordinator import Coordinator
from commlib.ft.sampling import permutation, share_weight, shares
from commlib.rendezvous import TCPStore, TCPStoreServer

# --- ephemeral keys ----------------------------------------------------------------------------


def test_an_ephemeral_key_dies_with_its_connection():
    server = TCPStoreServer("127.0.0.1", 0).start()
    try:
        owner = TCPStore("127.0.0.1", server.port, timeout=5)
        other = TCPStore("127.0.0.1", server.port, timeout=5)
        owner.set_ephemeral("live", "1")
        owner.set("kept", "2")
        assert other.get("live", 1) == b"1"
        before = other.num_keys()
        owner.close()
        deadline = time.monotonic() + 10  # the server drops the connection on its next event
        while other.check(["live"]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not other.check(["live"]), "the ephemeral key outlived its connection by 10 s"
        assert other.get("kept", 1) == b"2" and other.num_keys() == before - 1
        other.close()
    finally:
        server.close()


# --- the ledger --------------------------------------------------------------------------------


@pytest.mark.parametrize("global_batch,members", [(12, 3), (8, 3), (5, 4), (4, 4), (7, 1)])
def test_shares_cover_the_step_evenly(global_batch, members):
    parts = shares(global_batch, members)
    assert [i for part in parts for i in part] == list(range(global_batch))
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    weights = [share_weight(size, global_batch, members) for size in sizes]
    assert sum(weights) == pytest.approx(members)
    if global_batch % members == 0:
        assert weights == [1.0] * members


def test_the_ledger_trains_every_sample_once_across_membership_changes():
    ledger = Ledger(dataset_size=50, batch_size=4, seed=3)
    member_sets = [["a", "b", "c"]] * 3 + [["a", "c"]] * 4 + [["a", "c", "d"]] * 5
    trained = {}
    for step, members in enumerate(member_sets):
        step_indices = [ledger.indices(rank, len(members)) for rank in range(len(members))]
        record = ledger.commit(step // 4, members)
        assert record.global_batch == sum(len(part) for part in step_indices)
        for part in step_indices:
            trained.setdefault(record.data_epoch, []).extend(part.tolist())
    first = trained[0]
    assert sorted(first) == list(range(50)), "pass 0 is every sample once (none dropped at these sizes)"
    assert len(set(trained[1])) == len(trained[1])
    again = Ledger.from_json(ledger.to_json())
    assert again == ledger
    summary = ledger.summary()
    assert summary["steps"] == 12 and summary["replica_steps"] == sum(map(len, member_sets))
    assert summary["samples_per_data_epoch"][0] == 50


def test_samples_fewer_than_members_are_dropped_and_counted():
    ledger = Ledger(dataset_size=10, batch_size=4, seed=0)
    ledger.commit(0, ["a", "b"])  # 8 samples; 2 left
    assert ledger.plan(3) == 10  # 2 left < 3 members: dropped and counted; the next pass has 10
    assert ledger.dropped == {0: 2} and ledger.data_epoch == 1 and ledger.cursor == 0
    order = permutation(10, 0, 1)
    assert sorted(np.concatenate([ledger.indices(rank, 3) for rank in range(3)]).tolist()) == sorted(order.tolist())


# --- the coordinator ---------------------------------------------------------------------------


class Replicas:
    """Test clients playing replicas: each registers as the heartbeat thread does."""

    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator
        self.stores = {}
        self.beats = {}

    def register(self, replica: str, state=keys.WAITING, epoch=-1, step=0) -> None:
        store = TCPStore("127.0.0.1", self.coordinator.port, timeout=5)
        self.stores[replica] = store
        self.beats[replica] = 0
        self.beat(replica, state, epoch, step)
        store.set_ephemeral(keys.live(replica), "1")
        store.set(keys.slot(store.add(keys.SLOTS, 1) - 1), replica)

    def beat(self, replica: str, state=keys.WAITING, epoch=-1, step=0) -> None:
        self.beats[replica] += 1
        self.stores[replica].set(keys.heartbeat(replica), keys.Heartbeat(self.beats[replica], state, epoch,
                                                                          step).encode())

    def kill(self, replica: str) -> None:
        self.stores.pop(replica).close()

    def close(self) -> None:
        for store in self.stores.values():
            store.close()


@pytest.fixture
def coordinator():
    made = []

    def make(**options):
        options.setdefault("grace", 0.0)
        instance = Coordinator("127.0.0.1", 0, **options).open()
        made.append(instance)
        return instance, Replicas(instance)

    yield make
    for instance in made:
        instance.close()


def settle(coordinator: Coordinator, now: float) -> None:
    """Two ticks, the second past the join window: a quorum that can form, forms."""
    coordinator.decide(now)
    coordinator.decide(now + coordinator.join_window + 0.01)


def read(coordinator: Coordinator, key: str):
    store = coordinator.store
    return store.get(key, 1).decode() if store.check([key]) else None


def test_the_first_quorum_waits_for_its_replicas_and_the_join_window(coordinator):
    coord, replicas = coordinator(initial_replicas=3, join_window=0.5)
    t = coord.started
    replicas.register("b")
    replicas.register("a")
    coord.decide(t + 1)
    assert coord.current is None, "two of three initial replicas"
    replicas.register("c")
    coord.decide(t + 1.1)
    coord.decide(t + 1.3)
    assert coord.current is None, "the waiting set changed 0.2 s ago: inside the join window"
    for name in "abc":
        replicas.beat(name)
    coord.decide(t + 1.7)
    assert coord.current == keys.Quorum(0, ["a", "b", "c"], "first quorum")
    assert read(coord, keys.LATEST) == "0"
    assert keys.Quorum.decode(coord.store.get(keys.quorum(0), 1)) == coord.current
    replicas.close()


def test_a_member_whose_connection_closes_is_lost_at_once(coordinator):
    coord, replicas = coordinator(heartbeat_timeout=100.0)
    t = coord.started
    for name in "ab":
        replicas.register(name)
    settle(coord, t + 1)
    assert coord.current.members == ["a", "b"]
    for name in "ab":
        replicas.beat(name, keys.TRAINING, 0)
    coord.decide(t + 1.1)
    assert read(coord, keys.closed(0)) is None
    replicas.kill("b")
    coord.decide(t + 1.2)
    assert read(coord, keys.closed(0)) == "lost b (its connection closed)"
    replicas.beat("a", keys.WAITING, 0, 5)
    settle(coord, t + 2)
    assert coord.current == keys.Quorum(1, ["a"], "after epoch 0")
    replicas.close()


def test_a_member_whose_heartbeat_stops_is_lost_after_the_timeout(coordinator):
    coord, replicas = coordinator(heartbeat_timeout=2.0)
    t = coord.started
    for name in "ab":
        replicas.register(name)
    settle(coord, t + 1)
    for name in "ab":
        replicas.beat(name, keys.TRAINING, 0)
    coord.decide(t + 1.5)
    replicas.beat("a", keys.TRAINING, 0, 1)
    coord.decide(t + 3.0)  # b: 1.5 s without a change
    assert read(coord, keys.closed(0)) is None
    replicas.beat("a", keys.TRAINING, 0, 2)
    coord.decide(t + 3.6)  # b: 2.1 s
    assert read(coord, keys.closed(0)) == "lost b (no heartbeat for 2 s)"
    replicas.close()


def test_a_joiner_closes_the_epoch_and_enters_once_the_members_left_it(coordinator):
    coord, replicas = coordinator()
    t = coord.started
    for name in "ab":
        replicas.register(name)
    settle(coord, t + 1)
    for name in "ab":
        replicas.beat(name, keys.TRAINING, 0, 3)
    replicas.register("c")
    coord.decide(t + 2)
    assert read(coord, keys.closed(0)) == keys.JOIN_PREFIX + "c"
    coord.decide(t + 3)
    assert coord.current.epoch == 0, "a and b still train in epoch 0: drained first"
    replicas.beat("a", keys.WAITING, 0, 4)
    replicas.beat("b", keys.WAITING, 0, 4)
    replicas.beat("c")
    settle(coord, t + 3.1)
    assert coord.current == keys.Quorum(1, ["a", "b", "c"], "after epoch 0")
    replicas.close()


def test_a_lost_member_overrides_a_close_for_a_joiner(coordinator):
    coord, replicas = coordinator(heartbeat_timeout=100.0)
    t = coord.started
    for name in "ab":
        replicas.register(name)
    settle(coord, t + 1)
    replicas.register("c")
    coord.decide(t + 2)
    assert read(coord, keys.closed(0)).startswith(keys.JOIN_PREFIX)
    replicas.kill("b")
    coord.decide(t + 2.1)
    assert read(coord, keys.closed(0)) == "lost b (its connection closed)", \
        "the members must now end the epoch before their next step, not after it"
    replicas.close()


def test_a_restarted_coordinator_listens_first_and_numbers_above_every_epoch(coordinator):
    coord, replicas = coordinator(grace=3.0)
    t = coord.started
    replicas.register("a", keys.WAITING, 4, 17)
    replicas.register("b", keys.WAITING, 3, 12)
    coord.decide(t + 1)
    assert coord.current is None, "inside the grace period"
    replicas.beat("a", keys.WAITING, 4, 17)
    replicas.beat("b", keys.WAITING, 3, 12)
    settle(coord, t + 3.5)
    assert coord.current == keys.Quorum(5, ["a", "b"], "coordinator restarted")
    replicas.close()
