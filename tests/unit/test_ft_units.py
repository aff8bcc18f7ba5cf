"""commlib.ft in one process: the store's ephemeral keys, the sample ledger, and the coordinator's
decisions, driven tick by tick (``decide(now)`` with a chosen clock) against a real store server
whose heartbeats test clients write as replicas would."""

from __future__ import annotations

import contextlib
import threading
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


@contextlib.contextmanager
def deciding(coordinator: Coordinator):
    """The coordinator's decision loop on the real clock, in a thread, for a real Manager."""
    stop = threading.Event()

    def ticks():
        while not stop.is_set():
            coordinator.decide(time.monotonic())
            stop.wait(0.02)

    thread = threading.Thread(target=ticks, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


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


def _two_trained_and_a_joiner_waiting(coord, replicas, t: float, step: int = 5) -> None:
    """a and b trained epoch 0 to ``step``; c waits to join, at step 0."""
    for name in "ab":
        replicas.register(name)
    settle(coord, t + 1)
    for name in "ab":
        replicas.beat(name, keys.TRAINING, 0, step)
    replicas.register("c")
    coord.decide(t + 2)


def test_a_joiner_closes_the_epoch_and_enters_once_the_members_left_it(coordinator):
    coord, replicas = coordinator()
    t = coord.started
    _two_trained_and_a_joiner_waiting(coord, replicas, t, step=3)
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


def test_a_joiner_behind_replicas_that_all_left_or_exited_is_told_the_state_is_lost(coordinator):
    coord, replicas = coordinator(heartbeat_timeout=100.0)
    t = coord.started
    _two_trained_and_a_joiner_waiting(coord, replicas, t)
    replicas.beat("a", keys.LEFT, 0, 5)  # a finished and left; b still holds the state
    settle(coord, t + 3)
    assert read(coord, keys.STRANDED) is None and coord.current.epoch == 0
    replicas.kill("b")  # b's process exited: nobody can hold step 5 any more
    coord.decide(t + 4)
    assert read(coord, keys.STRANDED) == ("no live replica holds the job's state: the job is at step 5, and the "
                                          "replicas that trained it (a, b) have left or exited; a replica cannot "
                                          "catch up from disk")
    settle(coord, t + 5)
    assert coord.current.epoch == 0, "no quorum of replicas behind the job forms"
    replicas.close()


def test_a_joiner_behind_a_member_that_is_only_silent_waits_for_it(coordinator):
    """A member cut off from the network keeps its connection open: it may come back, so the
    joiner waits (a partition must not end the job)."""
    coord, replicas = coordinator(heartbeat_timeout=1.0)
    t = coord.started
    _two_trained_and_a_joiner_waiting(coord, replicas, t)
    replicas.beat("a", keys.LEFT, 0, 5)
    for now in (t + 4, t + 8, t + 12):  # b's heartbeat is long stale, its connection open
        replicas.beat("c")
        coord.decide(now)
    assert read(coord, keys.STRANDED) is None
    replicas.close()


def test_a_manager_behind_a_job_whose_replicas_all_left_raises_at_once_naming_them(coordinator):
    from commlib.errors import JobStateLostError
    from commlib.ft import Manager

    coord, replicas = coordinator(heartbeat_timeout=100.0)
    try:
        with deciding(coord):
            for name in "ab":
                replicas.register(name, keys.LEFT, 0, 7)
            manager = Manager(f"127.0.0.1:{coord.port}", replica_id="late", join_timeout=120.0)
            started = time.monotonic()
            with pytest.raises(JobStateLostError) as raised:
                manager.start_step()
            assert time.monotonic() - started < 10.0, "told at once, not at the join timeout"
            message = str(raised.value)
            assert "replica late (at step 0)" in message and "at step 7" in message and "(a, b)" in message, message
            assert any(event["kind"] == "stranded" for event in manager.events)
            manager.close()
    finally:
        replicas.close()


def _slow_after_the_first_quorum(coord, replicas, slow: str) -> None:
    """a, b, c form epoch 0; its members close it naming ``slow``, and all wait again."""
    t = coord.started
    for name in "abc":
        replicas.register(name)
    settle(coord, t + 1)
    assert coord.current.members == ["a", "b", "c"]
    coord.store.compare_set(keys.closed(0), "", keys.SLOW_PREFIX + f"{slow} (its best link 1.2 MB/s, ...)")
    for name in "abc":
        replicas.beat(name, keys.WAITING, 0, 4)
    settle(coord, t + 2)


def test_a_member_found_slow_waits_out_its_probation_doubled_each_time(coordinator):
    coord, replicas = coordinator(heartbeat_timeout=100.0, slow_probation=10.0)
    t = coord.started
    _slow_after_the_first_quorum(coord, replicas, "c")
    assert coord.current.members == ["a", "b"] and "on probation: c for 9.7 s more" in coord.current.reason
    for name in "ab":
        replicas.beat(name, keys.TRAINING, 1, 5)
    coord.decide(t + 11.9)
    assert read(coord, keys.closed(1)) is None, "c asked to join inside its probation"
    coord.decide(t + 12.1)
    assert read(coord, keys.closed(1)) == keys.JOIN_PREFIX + "c"
    for name in "ab":
        replicas.beat(name, keys.WAITING, 1, 6)
    settle(coord, t + 12.2)
    assert coord.current.members == ["a", "b", "c"]
    coord.store.compare_set(keys.closed(2), "", keys.SLOW_PREFIX + "c (still slow)")
    settle(coord, t + 12.3)  # nobody trained in epoch 2: the probe came before any step
    assert coord.current.members == ["a", "b"] and coord.probation["c"] == pytest.approx(t + 12.3 + 20.0)
    replicas.close()


def test_a_slow_replica_is_taken_when_the_quorum_cannot_form_without_it(coordinator):
    coord, replicas = coordinator(heartbeat_timeout=100.0, min_replicas=3)
    _slow_after_the_first_quorum(coord, replicas, "b")
    assert "b" in coord.probation and coord.current.members == ["a", "b", "c"], coord.current
    replicas.close()


def _rates(size: int, fast: float = 500e6, slow_out=(), slow_in=(), slow: float = 1e6) -> np.ndarray:
    rates = np.full((size, size), fast)
    for member in slow_out:
        rates[member, :] = slow
    for member in slow_in:
        rates[:, member] = slow
    np.fill_diagonal(rates, 0.0)
    return rates


@pytest.mark.parametrize("size", [3, 4, 6])
@pytest.mark.parametrize("direction", ["out", "in", "both"])
def test_the_member_with_a_slow_link_is_named_whichever_way_it_is_slow(size, direction):
    from commlib.ft.links import SlowReplicas, slowest_member

    member = size - 2
    rates = _rates(size, slow_out=[member] if direction != "in" else [],
                   slow_in=[member] if direction != "out" else [])
    found = slowest_member(rates, SlowReplicas())
    assert found is not None and found.rank == member and found.score == 1e6 and found.median == 500e6
    assert "2 MB/s" not in found.describe("h2") and found.describe("h2").startswith("h2 (its best link 1 MB/s")


def test_nobody_is_named_among_two_members_on_fast_links_or_above_the_floor():
    from commlib.ft.links import SlowReplicas, slowest_member

    assert slowest_member(_rates(2, slow_out=[1]), SlowReplicas()) is None, "a slow link of two is both's"
    assert slowest_member(_rates(4), SlowReplicas()) is None
    noisy = _rates(4)
    noisy[0, 1] = noisy[2, 3] = 1e6  # single slow links (a member descheduled once): each member has a fast one
    assert slowest_member(noisy, SlowReplicas()) is None
    rates = _rates(3, slow_out=[0], slow=30e6)  # 16x slower than the others, but above the floor given
    assert slowest_member(rates, SlowReplicas(below=5e6)) is None
    assert slowest_member(rates, SlowReplicas()).rank == 0


@pytest.mark.parametrize("options", [{"ratio": 1.5}, {"ratio": 0.0}, {"below": -1.0}, {"probe_bytes": 16},
                                     {"repeats": 0}, {"every": -1}, {"slow_step": 1.0}])
def test_a_slow_replica_policy_out_of_range_is_refused(options):
    from commlib.errors import InvalidUsageError
    from commlib.ft.links import SlowReplicas

    with pytest.raises(InvalidUsageError, match="SlowReplicas"):
        SlowReplicas(**options)


def test_a_manager_given_something_else_as_its_slow_replica_policy_refuses_before_connecting():
    from commlib.errors import InvalidUsageError
    from commlib.ft import Manager

    started = time.monotonic()
    with pytest.raises(InvalidUsageError, match="slow_replicas must be a SlowReplicas, got dict"):
        Manager("127.0.0.1:1", "r0", slow_replicas={"every": 5}, connect_timeout=30.0)
    assert time.monotonic() - started < 5.0, "it tried to reach the coordinator first"


def test_a_member_asks_for_a_probe_every_few_steps_and_after_a_step_much_slower_than_its_median(coordinator):
    from commlib.ft import Manager, SlowReplicas

    coord, _ = coordinator()
    manager = Manager(f"127.0.0.1:{coord.port}", "a", slow_replicas=SlowReplicas(every=5, slow_step=4.0))
    try:
        manager.quorum = keys.Quorum(0, ["a", "b", "c"])
        manager._allreduce_seconds.extend([0.01] * 6)
        assert not manager._wants_probe()
        manager._allreduce_seconds.append(0.05)  # 5x the median
        assert manager._wants_probe()
        manager._allreduce_seconds.clear()
        manager._allreduce_seconds.extend([0.01] * 3 + [0.05])
        assert not manager._wants_probe(), "too few steps in the epoch to know its median"
        for _ in range(4):
            manager.ledger.commit(0, ["a", "b", "c"])
        assert manager._wants_probe(), "the 5th step is probed after"
        manager.quorum = keys.Quorum(0, ["a", "b"])
        assert not manager._wants_probe(), "two members: a slow link is both's"
    finally:
        manager.close()


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
def test_the_probe_rounds_meet_every_pair_once_and_give_each_member_one_partner(size):
    from commlib.ft.links import pairings

    rounds = pairings(size)
    met = [tuple(sorted((member, partner))) for partners in rounds for member, partner in enumerate(partners)
           if partner >= 0]
    assert sorted(set(met)) == [(a, b) for a in range(size) for b in range(a + 1, size)]
    assert len(met) == size * (size - 1), "each pair once per round it meets, seen from both ends"
    for partners in rounds:
        assert all(partner < 0 or partners[partner] == member for member, partner in enumerate(partners))
    assert len(rounds) == (size - 1 if size % 2 == 0 else size)


class _Bucket:
    """What manager_comm_hook reads of torch's GradBucket (torch builds real ones only inside a
    DDP backward, which cannot be interrupted and go on: its reducer is unusable after)."""

    def __init__(self, index, last, params, buffer):
        self._index, self._last, self._params, self._buffer = index, last, params, buffer

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params

    def index(self):
        return self._index

    def is_last(self):
        return self._last


@contextlib.contextmanager
def only_replica(coordinator):
    """A manager that is its job's only replica (quorums of one: the mean is its own gradient)."""
    from commlib.ft import Manager

    coord, replicas = coordinator(heartbeat_timeout=100.0, initial_replicas=1, min_replicas=1, join_window=0.05)
    with deciding(coord):
        manager = Manager(f"127.0.0.1:{coord.port}", replica_id="only", join_timeout=60.0)
        try:
            yield manager
        finally:
            manager.close()
            replicas.close()


def test_the_torch_ddp_hook_drops_what_an_interrupted_backward_left(coordinator):
    """A backward that stopped after its first bucket leaves that bucket in the hook's state; the
    next backward's bucket 0 drops it, so the average holds this backward's buckets only, and the
    stale bucket's future is never completed (one replica: the average is the gradient itself)."""
    torch = pytest.importorskip("torch")
    from ddp.fault_tolerant import ManagerHookState, manager_comm_hook

    with only_replica(coordinator) as manager:
        module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        params = list(module.parameters())
        state = ManagerHookState(manager, module)

        def bucket(index, last, held):  # a buffer of the bucket's parameters, scaled to tell them apart
            return _Bucket(index, last, held, torch.cat([p.detach().reshape(-1) * (index + 1) for p in held]))

        manager.start_step()
        stale = manager_comm_hook(state, bucket(0, False, params[2:]))  # ... and backward stopped there
        first, last = bucket(0, False, params[2:]), bucket(1, True, params[:2])
        expected = [first.buffer().clone(), last.buffer().clone()]
        futures = [manager_comm_hook(state, first), manager_comm_hook(state, last)]
        assert all(future.done() for future in futures) and not stale.done()
        for future, want in zip(futures, expected):
            assert torch.equal(future.value(), want)
        assert state.pending == []


def test_the_torch_ddp_hook_refuses_to_open_a_step_inside_backward(coordinator):
    """fault_tolerant_torch_ddp's hook, with no step open when backward reaches it, raises a
    named error instead of joining a quorum (and loading a peer's parameters) mid-backward; the
    manager is untouched and opens the step at the optimizer's zero_grad."""
    torch = pytest.importorskip("torch")
    from ddp import fault_tolerant_torch_ddp

    with only_replica(coordinator) as manager:
        torch.manual_seed(0)
        model = fault_tolerant_torch_ddp(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                                             torch.nn.Linear(8, 2)), manager)
        opt = manager.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        inputs = torch.randn(6, 4)
        with pytest.raises(Exception, match="manager_comm_hook: no step is open: call zero_grad"):
            model(inputs).square().sum().backward()
        assert manager.group is None and not manager.step_open, "no quorum was joined inside backward"
        opt.zero_grad()  # the step opens where it should (torch's reducer, after a hook raised, is
        assert manager.step_open and manager.group is not None  # not usable again: that is torch's)


def test_two_models_on_one_manager_are_registered_apart_and_both_averaged(coordinator):
    """Two models on one manager (a generator and a discriminator, say): each is registered for
    catch-up under its own name, in the order the program makes them, and each model's gradients
    are averaged in the step (one replica: the mean is its own, and the step commits)."""
    torch = pytest.importorskip("torch")
    from ddp import FaultTolerantDDP, fault_tolerant_torch_ddp

    with only_replica(coordinator) as manager:
        torch.manual_seed(0)
        nets = [torch.nn.Linear(4, 3), torch.nn.Linear(3, 2), torch.nn.Linear(2, 1)]
        models = [fault_tolerant_torch_ddp(nets[0], manager), fault_tolerant_torch_ddp(nets[1], manager),
                  FaultTolerantDDP(nets[2], manager)]
        assert [name for name in manager.states if name.startswith("model")] == ["model", "model.1", "model.2"]
        for name, net in zip(("model", "model.1", "model.2"), nets):
            save, _ = manager.states[name]
            assert save().keys() == net.state_dict().keys()
            assert all(torch.equal(save()[key], value) for key, value in net.state_dict().items())
        opt = manager.optimizer(torch.optim.SGD([p for net in nets for p in net.parameters()], lr=0.1))
        before = [p.detach().clone() for net in nets for p in net.parameters()]
        opt.zero_grad()
        models[2](models[1](models[0](torch.randn(5, 4)))).square().sum().backward()
        grads = [p.grad.clone() for net in nets for p in net.parameters()]
        assert opt.step() is not False and manager.steps == 1
        after = [p.detach() for net in nets for p in net.parameters()]
        assert all(torch.allclose(b - 0.1 * g, a) for b, g, a in zip(before, grads, after))
