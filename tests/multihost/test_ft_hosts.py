"""Fault-tolerant data parallelism across hosts of network namespaces: one replica per host, the
coordinator on the first. A host cut off from the network (``ip link set eth0 down``) sends
nothing, not even a close: the others' allreduce would wait for it until the group's timeout.
The coordinator misses its heartbeats, closes the epoch as ``lost``, the members abort their
group and go on without it; when the link is back, the host's replica learns that its group
was aborted, rejoins, and catches up from a live peer. Every check of tests/ft holds, bitwise
equality with a replay of the ledger included.
"""

from __future__ import annotations

import re
import sys
import time

import pytest
import torch

from tests.support.ft_run import Run, Runs, assert_each_cross_group_aborted, check_replica_groups, check_run
from tests.support.ft_scenarios import play_at_random, soak
from tests.support.launch import ROOT, kill_tree
from tests.support.multihost import make_cluster, processes_on_hosts

pytestmark = pytest.mark.multihost

HEARTBEAT_TIMEOUT = 3.0  # the coordinator's (beats every 0.1 s): a margin for a loaded machine
# The replicas pause before step CUT_AT until its gate (h2 is cut off meanwhile), and hold
# before RESUME_AT until its gate and a close for a joiner (r2, back).
CUT_AT, RESUME_AT, STEPS = 3, 7, 11


@pytest.fixture(scope="module")
def cluster():
    with make_cluster(3) as made:
        yield made


@pytest.fixture
def run_factory(tmp_path, cluster):
    runs = Runs(tmp_path, cluster=cluster, hosts={"coordinator": "h0", "r0": "h0", "r1": "h1", "r2": "h2", "r3": "h1"},
                heartbeat_timeout=HEARTBEAT_TIMEOUT)
    yield runs
    runs.close()


def _link(cluster, host: str, state: str) -> None:
    result = cluster.exec(host, ["ip", "link", "set", "eth0", state], timeout=30)
    assert result.returncode == 0, result.stdout


def _cut_h2_off_and_back(run, cluster, cut_at: int = CUT_AT, resume_at: int = RESUME_AT) -> float:
    """With r0, r1 and r2 started (pausing before ``cut_at``, holding before ``resume_at``): cut
    h2 off as step ``cut_at`` starts, wait until the others trained on to ``resume_at``, bring it
    back, and let everyone go on once r2 asked to join. Returns when the link went down."""
    run.wait_until(lambda: all(run.progress(replica) >= cut_at for replica in ("r0", "r1", "r2")),
                   f"every replica to commit {cut_at} steps")
    _link(cluster, "h2", "down")
    cut = time.time()
    try:
        run.gate(cut_at).touch()  # step cut_at starts with h2 unreachable
        run.wait_until(lambda: run.progress("r0") >= resume_at and run.progress("r1") >= resume_at,
                       "r0 and r1 to train on without the host that was cut off")
        assert run.progress("r2") == cut_at, "a replica that could reach nobody committed a step"
    finally:
        _link(cluster, "h2", "up")
    run.wait_until(lambda: run.coordinator_said("join: r2"), "r2 to ask to join again")
    run.gate(resume_at).touch()
    return cut


def test_a_host_cut_off_is_dropped_within_seconds_then_rejoins_and_catches_up(run_factory, cluster):
    scenario_cut_off(run_factory, cluster, CUT_AT, RESUME_AT, STEPS)


def scenario_cut_off(run_factory, cluster, cut_at: int, resume_at: int, steps: int) -> dict:
    """h2 cut off as step ``cut_at`` starts, back once r0 and r1 reached ``resume_at``; every
    check of the run, and of the abort, the catch-up and the time to the next commit."""
    run = run_factory(3)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, steps, pauses=[cut_at], holds=[resume_at])
    cut = _cut_h2_off_and_back(run, cluster, cut_at, resume_at)
    summary = check_run(run, ["r0", "r1", "r2"], steps, {}, failures=1)
    members = summary["members_per_step"]
    assert members[:cut_at] == [3] * cut_at and members[cut_at] == 2 and members[-1] == 3, members
    results = {replica: torch.load(run.result_path(replica), weights_only=False) for replica in ("r0", "r1", "r2")}
    # The first member whose heartbeat read the close aborted the group; the other heard its ABORT.
    aborted = [event for replica in ("r0", "r1") for event in results[replica]["events"]
               if event["kind"] == "group-aborted"]
    assert aborted and all(event["reason"].startswith("lost r2 (no heartbeat") for event in aborted), aborted
    failed = [event for replica in ("r0", "r1") for event in results[replica]["events"]
              if event["kind"] == "allreduce-failed" and event["epoch"] == 0]
    assert len(failed) == 2 and all("lost r2" in event["error"] for event in failed), failed
    commit = min(event["t"] for event in results["r0"]["events"]
                 if event["kind"] == "commit" and event["step"] == cut_at)
    caught_up = [event for event in results["r2"]["events"] if event["kind"] == "caught-up"]
    assert caught_up and caught_up[-1]["steps"] >= resume_at, results["r2"]["events"]
    print(f"h2 cut off -> step {cut_at} committed without it {commit - cut:.2f} s later "
          f"(heartbeat timeout {HEARTBEAT_TIMEOUT:g} s); members per step {members}", flush=True)
    assert commit - cut < HEARTBEAT_TIMEOUT + 10.0  # not the group's timeout (30 s in the replicas)
    run.close()  # the coordinator
    assert processes_on_hosts(cluster) == {}, "processes left behind on the hosts"
    return summary


def test_a_replica_of_two_ranks_on_a_host_cut_off_is_dropped_and_every_rank_takes_its_block_back(run_factory,
                                                                                                   cluster):
    """Each host's replica is an mpiexec job of two ranks (tests/ft/replica_group_ranks.py: a
    model split by features, the prediction's parts summed over the host's MPI); h2 is cut off
    as a step starts. The others' two cross-replica groups (one per local rank) are aborted by
    their own members' watchers when the coordinator closes the epoch; when the link is back,
    each of h2's ranks rejoins and takes its block from its counterpart. Every rank ends bitwise
    where the replay of the ledger ends."""
    run = run_factory(3)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica_group(replica, STEPS, 2, pauses=[CUT_AT], holds=[RESUME_AT])
    _cut_h2_off_and_back(run, cluster)
    members, results = check_replica_groups(run, ["r0", "r1", "r2"], 2)
    assert members[:CUT_AT] == [3] * CUT_AT and members[CUT_AT] == 2 and members[-1] == 3, members
    assert_each_cross_group_aborted(results, ["r0", "r1"], 2)
    for rank in range(2):
        assert "caught-up" in results["r2"][rank]["events"], results["r2"][rank]["events"]
    run.close()  # the coordinator
    assert processes_on_hosts(cluster) == {}, "processes left behind on the hosts"


# The slow-host test: h2's link drops to SLOW_RATE while the replicas train. They probe their
# links every PROBE_EVERY steps and at every epoch's start; a member whose best link carries
# under SLOW_BELOW is slow (10 Mbit/s is 1.25 MB/s; an unshaped veth, even on a loaded machine,
# is tens to hundreds) and under SLOW_RATIO of the median member's. The ratio is looser than
# the default 0.1: on a starved machine a fast link times as slow as the sender takes to wake
# up, which brings the median down. The
# coordinator's probation starts at PROBATION s and doubles: r0 and r1 must reach their next
# hold within it (a new group and two steps: about a second here, loaded).
SLOW_RATE, SLOW_BELOW, SLOW_RATIO, PROBE_EVERY, PROBATION = "10mbit", 5e6, 0.3, 2, 4.0
SLOW_AT, SECOND_LOOK, BACK_AT, SLOW_STEPS = 3, 6, 9, 13


def test_a_host_whose_link_turns_slow_is_excluded_and_rejoins_once_it_is_fast_again(run_factory, cluster):
    """h2 still heartbeats, but its link is at 10 Mbit/s: the probe after the next committed
    step names it, the epoch ends there (no step is redone), and r0 and r1 train on. When its
    probation ends it joins again, is probed before any catch-up, and is sent back while it is
    slow (probation doubled); once its link is fast again it joins, catches up and trains to
    the end. Every check of a run holds, bitwise equality with the replay included."""
    scenario_slow_host(run_factory, cluster, SLOW_AT)


def scenario_slow_host(run_factory, cluster, slow_at: int) -> dict:
    """h2's link slowed as step ``slow_at`` starts (odd: the probe after step ``slow_at + 1``,
    a multiple of PROBE_EVERY, finds it), a second look ``SECOND_LOOK - SLOW_AT`` steps later,
    back ``BACK_AT - SLOW_AT`` steps after it; see the test above."""
    second_look, back_at = slow_at + SECOND_LOOK - SLOW_AT, slow_at + BACK_AT - SLOW_AT
    steps = slow_at + SLOW_STEPS - SLOW_AT
    run = run_factory(3)
    run.start_coordinator(slow_probation=PROBATION)
    options = ["--probe-every", str(PROBE_EVERY), "--slow-below", str(SLOW_BELOW), "--slow-ratio", str(SLOW_RATIO)]
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, steps, pauses=[slow_at], holds=[second_look, back_at], options=options)
    run.wait_until(lambda: all(run.progress(replica) >= slow_at for replica in ("r0", "r1", "r2")),
                   f"every replica to commit {slow_at} steps")
    slow_log = "r2 is slow; on probation"
    try:
        cluster.limit("h2", SLOW_RATE)
        run.gate(slow_at).touch()
        run.wait_until(lambda: run.coordinator_said(slow_log), "the coordinator to put r2 on probation")
        # r0 and r1 train on without r2 and hold before second_look until r2, its probation
        # over, asks to join.
        run.wait_until(lambda: run.coordinator_said("join: r2"), "r2 to ask to join while slow")
        if min(run.progress("r0"), run.progress("r1")) < second_look:
            run.fail(f"r2's probation of {PROBATION:g} s ended before r0 and r1 reached step {second_look}")
        run.gate(second_look).touch()
        run.wait_until(lambda: run.coordinator_said(slow_log, 2), "r2 to be sent back while still slow")
        assert run.progress("r2") == slow_at + 1, "a replica on probation committed steps"
    finally:
        cluster.limit("h2", None)
    run.wait_until(lambda: run.coordinator_said("join: r2", 2), "r2 to ask to join with a fast link")
    if min(run.progress("r0"), run.progress("r1")) < back_at:
        run.fail(f"r2's probation of {2 * PROBATION:g} s ended before r0 and r1 reached step {back_at}")
    run.gate(back_at).touch()
    summary = check_run(run, ["r0", "r1", "r2"], steps, {})
    members = summary["members_per_step"]
    # The probe after step slow_at + 1 (a multiple of PROBE_EVERY) found r2: that step stands.
    assert members[:slow_at + 1] == [3] * (slow_at + 1) and members[slow_at + 1] == 2, members
    assert members[-1] == 3 and 3 not in members[slow_at + 1:back_at], members
    results = {replica: torch.load(run.result_path(replica), weights_only=False) for replica in ("r0", "r1", "r2")}
    probes = [event for event in results["r0"]["events"] if event["kind"] == "probe" and "r2" in event["members"]]
    verdicts = [event["slow"] for event in probes]
    assert verdicts.count("r2") == 2 and verdicts[-1] is None and verdicts[0] is None, verdicts
    slow_rates = [min(max(row[2] for index, row in enumerate(event["rates_mb_s"]) if index != 2),
                      max(rate for index, rate in enumerate(event["rates_mb_s"][2]) if index != 2))
                  for event in probes if event["slow"] == "r2"]
    fast_rates = [min(max(rate for index, rate in enumerate(event["rates_mb_s"][0]) if index != 0),
                      max(row[0] for index, row in enumerate(event["rates_mb_s"]) if index != 0))
                  for event in probes]
    assert max(slow_rates) < SLOW_BELOW / 1e6 < min(fast_rates), (slow_rates, fast_rates)
    caught_up = [event for event in results["r2"]["events"] if event["kind"] == "caught-up"]
    assert len(caught_up) == 1 and caught_up[0]["steps"] >= back_at, results["r2"]["events"]
    print(f"h2 at {SLOW_RATE}: excluded twice (its best link {max(slow_rates):.2f} MB/s, r0's at "
          f"least {min(fast_rates):.0f} MB/s), back with a fast link; members per step {members}", flush=True)
    run.close()
    assert processes_on_hosts(cluster) == {}, "processes left behind on the hosts"
    return summary


@pytest.mark.soak
@pytest.mark.parametrize("scenario", ["cut_off", "slow_host", "kill_and_join", "two_at_once", "coordinator_restart",
                                      "source_killed_during_catch_up"])
def test_soak_across_hosts(run_factory, cluster, scenario):
    """Each scenario 10 times at random steps, the replicas on three hosts (r0 on h0 with the
    coordinator, r1 on h1, r2 on h2, a joiner r3 on h1): h2 cut off as step 1-5 starts (back 4
    steps later); h2's link slowed as step 1, 3 or 5 starts; and the loopback soaks' scenarios
    (tests/support/ft_scenarios.py). Every check of every run must hold."""
    def play(rng):
        if scenario == "cut_off":
            cut_at = rng.randrange(1, 6)
            return cut_at, scenario_cut_off(run_factory, cluster, cut_at, cut_at + 4, cut_at + 8)["members_per_step"]
        if scenario == "slow_host":
            slow_at = rng.choice([1, 3, 5])
            return slow_at, scenario_slow_host(run_factory, cluster, slow_at)["members_per_step"]
        return play_at_random(run_factory, scenario, rng)

    soak(f"hosts-{scenario}", run_factory, play)
    assert processes_on_hosts(cluster) == {}, "processes left behind on the hosts"


# The digits job: 20 passes over the data (96 samples a step, 1437 to train on; at 150 steps the
# accuracy still moved by more than a point with the member sets); while h1 is away, a
# two-member step's allreduce (about 600 KB) takes half a second at the rate, about a second with
# the reference job's traffic on the same link (measured: 6-8 such steps in the 8 s h1 was away).
DIGITS_STEPS, DIGITS_SLOW_RATE = 300, "10mbit"


class DigitsJob(Run):
    """mpi_examples/train_digits_ft.py on every host of ``cluster`` (replica ``hK`` on host ``hK``),
    its coordinator on h0: a :class:`Run` whose replicas are the example."""

    def __init__(self, cluster, directory, steps: int):
        hosts = {f"h{index}": f"h{index}" for index in range(len(cluster.hostnames))}
        super().__init__(directory, len(hosts), cluster=cluster, hosts={"coordinator": "h0", **hosts},
                         heartbeat_timeout=HEARTBEAT_TIMEOUT, run_timeout=240.0)
        self.steps = steps
        self.start_coordinator()

    def start(self, host: str) -> None:
        self.processes[host] = self._start(host, [
            sys.executable, str(ROOT / "mpi_examples" / "train_digits_ft.py"), "--coordinator",
            f"{self.address}:{self.port}", "--id", host, "--steps", str(self.steps), "--log-every", "5",
            "--events", str(self.directory / f"{host}.json")])

    def log(self, host: str) -> str:
        return (self.directory / f"{host}.log").read_text()

    def step(self, host: str) -> int:
        steps = re.findall(rf"^{host}: step (\d+) with", self.log(host), re.M)
        return int(steps[-1]) if steps else 0

    def finish(self) -> dict:
        """Every replica's final line: {host: (accuracy, replicas per step, sha256)}."""
        for host in self.processes:
            if self.wait(host) != 0:
                self.fail(f"{host} exited with {self.processes[host].returncode}")
        results = {}
        for host in self.processes:
            found = re.search(rf"^{host}: {self.steps} steps, test accuracy ([\d.]+)%; replicas per step ([\dx ]+); "
                              r"samples per pass .*; parameters sha256 (\w+)$", self.log(host), re.M)
            if found is None:
                self.fail(f"{host} did not print its result line")
            results[host] = (float(found.group(1)), found.group(2), found.group(3))
        return results


def test_the_digits_example_loses_a_host_and_takes_it_back_with_the_same_accuracy(cluster, tmp_path):
    """The issue's main job: train_digits_ft.py on three hosts, h1's replica SIGKILLed at step 20
    and started again once the others committed a step without it; beside it, at the same time
    (each job has its coordinator), the same job without failures. The same accuracy (within a
    point: the data order follows the member sets), and every replica ends with the same
    parameters. h1's return takes seconds (a new Python, torch, the data), more on a loaded
    machine: meanwhile h2's link is held at DIGITS_SLOW_RATE, so h0 and h2 train on without it
    at about a step a second, sleeping, and do not finish first; the limit is lifted when h1
    asks to join. (Each job's step results do not depend on when its steps ran.)"""
    steps = DIGITS_STEPS
    jobs = {}
    try:
        for name in ("reference", "faulty"):
            (tmp_path / name).mkdir()
            jobs[name] = DigitsJob(cluster, tmp_path / name, steps)
            for host in ("h0", "h1", "h2"):
                jobs[name].start(host)
        job = jobs["faulty"]
        job.wait_until(lambda: job.step("h1") >= 20, "h1 to reach step 20")
        kill_tree(job.processes["h1"].pid)
        cluster.limit("h2", DIGITS_SLOW_RATE)
        job.processes["h1"].wait(30)
        job.wait_until(lambda: re.search(r"^h0: step \d+ with 2 replicas", job.log("h0"), re.M),
                       "h0 and h2 to train on without h1")
        job.start("h1")  # the same command again: it joins and catches up
        job.wait_until(lambda: job.coordinator_said("join: h1"), "h1 to ask to join again")
        cluster.limit("h2", None)
        runs = {name: job.finish() for name, job in jobs.items()}
    finally:
        cluster.limit("h2", None)
        for job in jobs.values():
            job.close()
    reference, faulty = runs["reference"], runs["faulty"]
    assert len({result[2] for result in faulty.values()}) == 1, faulty  # one model on every replica
    accuracy, members, _ = faulty["h0"]
    assert reference["h0"][1] == f"3x{steps}" and members.startswith("3x") and " 2x" in members, (reference, faulty)
    assert members.endswith(" 3x" + members.rsplit(" 3x", 1)[-1]) and members.count(" ") == 2, members
    assert abs(accuracy - reference["h0"][0]) <= 1.0 and accuracy > 85.0, (reference, faulty)
    print(f"digits on 3 hosts, h1 killed and restarted: accuracy {accuracy:.2f}% (without failures "
          f"{reference['h0'][0]:.2f}%), replicas per step {members}", flush=True)
    from commlib.ft import timeline

    events = [str(tmp_path / "faulty" / f"{host}.json") for host in ("h0", "h1", "h2")]
    assert timeline.main([*events, "--png", str(tmp_path / "digits-timeline.png")]) == 0
    assert processes_on_hosts(cluster) == {}, "processes left behind on the hosts"
