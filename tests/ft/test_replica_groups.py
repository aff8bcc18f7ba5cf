"""Replicas of several ranks (``commlib.ft.Manager(local_group=...)``), each its own mpiexec job of
two ranks (tests/ft/replica_group_ranks.py: a model split by features across the ranks, the
parts of each prediction summed over MPI, each rank's block averaged with its counterparts
over sockets). Three replicas train; one replica's whole job is SIGKILLed and started again
later: it takes each rank's block from its counterpart in a live replica. Every replica's rank
``j`` must end with the same bits, those of a replay of the ledger (the same per-step member
sets, no failure), and the ranks of a replica with the same ledger."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.support.ft_run import Runs
from tests.support.ft_sharded import replay
from tests.support.mpirun import ROOT, mpiexec_path
from tests.support.processes import kill_tree, stop_tree

SCRIPT = ROOT / "tests" / "ft" / "replica_group_ranks.py"
RANKS = 2


@pytest.fixture
def runs(tmp_path):
    runs = Runs(tmp_path)
    yield runs
    runs.close()


def start_replica(run, replica: str, steps: int, holds=(), pauses=()):
    run.processes[replica] = run._start(replica, [
        mpiexec_path(), "-n", str(RANKS), sys.executable, str(SCRIPT), "--coordinator", f"{run.address}:{run.port}",
        "--id", replica, "--steps", str(steps), "--out", str(run.directory),
        *[f"--hold={step}:{run.gate(step)}" for step in holds],
        *[f"--pause={step}:{run.gate(step)}" for step in pauses]])


def finish(run, replicas):
    """Wait for ``replicas``; every rank's result, checked against the replay of r0's ledger."""
    for replica in replicas:
        if run.wait(replica) != 0:
            run.fail(f"{replica} exited with {run.processes[replica].returncode}")
    outcomes = {replica: [json.loads((run.directory / f"{replica}.{rank}.json").read_text()) for rank in range(RANKS)]
                for replica in replicas}
    ledger = outcomes[replicas[0]][0]["ledger"]
    expected = replay(ledger, RANKS)
    for replica, ranks in outcomes.items():
        for rank, result in enumerate(ranks):
            assert result["ledger"] == ledger, f"{replica} rank {rank}: another ledger"
            weights = np.frombuffer(bytes.fromhex(result["weights"]), np.float64)
            assert weights.tobytes() == expected[rank].tobytes(), (
                f"{replica} rank {rank}: {weights} vs the replay's {expected[rank]}")
    assert not np.array_equal(expected[0], expected[1]), "the two blocks should differ (else the test shows less)"
    return [len(step["members"]) for step in ledger["steps"]], outcomes


def test_a_replica_of_two_ranks_is_killed_rejoins_and_every_rank_takes_its_own_block(runs):
    steps, killed_at, rejoined_at = 14, 6, 10
    run = runs(3)
    run.env.pop("MPI4PY_RC_INITIALIZE", None)  # these replicas are MPI jobs
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        start_replica(run, replica, steps, holds=[killed_at] + ([rejoined_at] if replica != "r1" else []))
    run.wait_until(lambda: all(run.progress(r) == killed_at for r in ("r0", "r1", "r2")),
                   f"every replica to commit {killed_at} steps")
    kill_tree(run.processes["r1"].pid)  # mpiexec and both of r1's ranks
    run.processes["r1"].wait(30)
    run.gate(killed_at).touch()
    run.wait_until(lambda: run.progress("r0") == run.progress("r2") == rejoined_at,
                   f"r0 and r2 to commit step {rejoined_at} without r1")
    start_replica(run, "r1", steps)  # the same command again: a fresh job, weights zero, step 0
    run.wait_until(lambda: run.coordinator_said("join: r1"), "r1 to ask to join again")
    run.gate(rejoined_at).touch()
    members, _ = finish(run, ["r0", "r1", "r2"])
    # (r1 asks to join while r0 and r2 hold before step 11: that step commits as their epoch's last, then three)
    assert members == [3] * killed_at + [2] * (rejoined_at + 1 - killed_at) + [3] * (steps - rejoined_at - 1), members


def test_a_hung_replica_of_two_ranks_is_dropped_by_every_rank_of_the_others(runs):
    """r1's job stopped (SIGSTOP: alive, its sockets open, silent) while r0 and r2 are in a step
    with it: the coordinator misses its heartbeats and closes the epoch as lost; the ranks of r0
    and r2, local rank 1 too, watch for that and abort their own cross-replica groups (else local
    rank 1 would wait for r1's local rank 1 until the group's timeout), and the step is redone
    without r1."""
    steps, hung_at = 12, 5
    run = runs(3)
    run.env.pop("MPI4PY_RC_INITIALIZE", None)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        start_replica(run, replica, steps, pauses=[hung_at])
    run.wait_until(lambda: all(run.progress(r) == hung_at for r in ("r0", "r1", "r2")),
                   f"every replica to commit {hung_at} steps")
    stop_tree(run.processes["r1"].pid)
    run.gate(hung_at).touch()  # r0 and r2 go on into a step with r1, which never answers
    try:
        members, outcomes = finish(run, ["r0", "r2"])
    finally:
        kill_tree(run.processes["r1"].pid)
    assert members == [3] * hung_at + [2] * (steps - hung_at), members
    for rank in range(RANKS):  # cross group ``rank`` (local rank 1's: only non-leaders): one member aborted it
        # (then its abort reaches the others; a member that timed out instead would have no such event)
        events = {replica: outcomes[replica][rank]["events"] for replica in ("r0", "r2")}
        assert any("group-aborted" in kinds for kinds in events.values()), f"local rank {rank}: {events}"
    assert run.coordinator_said("lost r1 (no heartbeat"), run.logs()
