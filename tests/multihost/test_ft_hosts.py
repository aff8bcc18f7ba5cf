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

from tests.support.ft_run import Run, Runs, check_run
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
    runs = Runs(tmp_path, cluster=cluster, hosts={"coordinator": "h0", "r0": "h0", "r1": "h1", "r2": "h2"},
                heartbeat_timeout=HEARTBEAT_TIMEOUT)
    yield runs
    runs.close()


def _link(cluster, host: str, state: str) -> None:
    result = cluster.exec(host, ["ip", "link", "set", "eth0", state], timeout=30)
    assert result.returncode == 0, result.stdout


def test_a_host_cut_off_is_dropped_within_seconds_then_rejoins_and_catches_up(run_factory, cluster):
    run = run_factory(3)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, STEPS, pauses=[CUT_AT], holds=[RESUME_AT])
    run.wait_until(lambda: all(run.progress(replica) >= CUT_AT for replica in ("r0", "r1", "r2")),
                   f"every replica to commit {CUT_AT} steps")
    _link(cluster, "h2", "down")
    cut = time.time()
    try:
        run.gate(CUT_AT).touch()  # step CUT_AT starts with h2 unreachable
        run.wait_until(lambda: run.progress("r0") >= RESUME_AT and run.progress("r1") >= RESUME_AT,
                       "r0 and r1 to train on without the host that was cut off")
        assert run.progress("r2") == CUT_AT, "a replica that could reach nobody committed a step"
    finally:
        _link(cluster, "h2", "up")
    run.wait_until(lambda: run.coordinator_said("join: r2"), "r2 to ask to join again")
    run.gate(RESUME_AT).touch()
    summary = check_run(run, ["r0", "r1", "r2"], STEPS, {})
    members = summary["members_per_step"]
    assert members[:CUT_AT] == [3] * CUT_AT and members[CUT_AT] == 2 and members[-1] == 3, members
    results = {replica: torch.load(run.result_path(replica), weights_only=False) for replica in ("r0", "r1", "r2")}
    # The first member whose heartbeat read the close aborted the group; the other heard its ABORT.
    aborted = [event for replica in ("r0", "r1") for event in results[replica]["events"]
               if event["kind"] == "group-aborted"]
    assert aborted and all(event["reason"].startswith("lost r2 (no heartbeat") for event in aborted), aborted
    failed = [event for replica in ("r0", "r1") for event in results[replica]["events"]
              if event["kind"] == "allreduce-failed" and event["epoch"] == 0]
    assert len(failed) == 2 and all("lost r2" in event["error"] for event in failed), failed
    commit = min(event["t"] for event in results["r0"]["events"]
                 if event["kind"] == "commit" and event["step"] == CUT_AT)
    caught_up = [event for event in results["r2"]["events"] if event["kind"] == "caught-up"]
    assert caught_up and caught_up[-1]["steps"] >= RESUME_AT, results["r2"]["events"]
    print(f"h2 cut off -> step {CUT_AT} committed without it {commit - cut:.2f} s later "
          f"(heartbeat timeout {HEARTBEAT_TIMEOUT:g} s); members per step {members}", flush=True)
    assert commit - cut < HEARTBEAT_TIMEOUT + 10.0  # not the group's timeout (30 s in the replicas)
    run.close()  # the coordinator
    assert processes_on_hosts(cluster) == {}, "processes left behind on the hosts"


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


def run_digits(cluster, directory, steps: int, fail: bool) -> dict:
    """One job of the example; with ``fail``, h1's replica is SIGKILLed at step 20 and started
    again once the others committed a step without it (the steps are many: they must not finish
    before it is back, which takes seconds on a loaded machine)."""
    directory.mkdir()
    job = DigitsJob(cluster, directory, steps)
    try:
        for host in ("h0", "h1", "h2"):
            job.start(host)
        if fail:
            job.wait_until(lambda: job.step("h1") >= 20, "h1 to reach step 20")
            kill_tree(job.processes["h1"].pid)
            job.processes["h1"].wait(30)
            job.wait_until(lambda: re.search(r"^h0: step \d+ with 2 replicas", job.log("h0"), re.M),
                           "h0 and h2 to train on without h1")
            job.start("h1")  # the same command again: it joins and catches up
        return job.finish()
    finally:
        job.close()


def test_the_digits_example_loses_a_host_and_takes_it_back_with_the_same_accuracy(cluster, tmp_path):
    """The issue's main job: train_digits_ft.py on three hosts, h1's replica killed and started
    again. Against a run without failures: the same accuracy (within a point: the data order
    follows the member sets), and every replica ends with the same parameters."""
    steps = 600  # the others must not finish before h1 is back: it takes seconds to restart
    runs = {name: run_digits(cluster, tmp_path / name, steps, fail) for name, fail in (("reference", False),
                                                                                        ("faulty", True))}
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
