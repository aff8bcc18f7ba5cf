"""Fault-tolerant data parallelism across hosts of network namespaces: one replica per host, the
coordinator on the first. A host cut off from the network (``ip link set eth0 down``) sends
nothing, not even a close: the others' allreduce would wait for it until the group's timeout.
The coordinator misses its heartbeats, closes the epoch as ``lost``, the members abort their
group and go on without it; when the link is back, the host's replica learns that its group
was aborted, rejoins, and catches up from a live peer. Every check of tests/ft holds, bitwise
equality with a replay of the ledger included.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.support.ft_run import Runs, check_run
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
