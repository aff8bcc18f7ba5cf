"""Replicas of several ranks (``commlib.ft.Manager(local_group=...)``) on this host, each its own
mpiexec job of two ranks (tests/ft/replica_group_ranks.py: a model split by features across the
ranks, the parts of each prediction summed over MPI, each rank's block averaged with its
counterparts over sockets). One replica's whole job is SIGKILLed and started again later: it
takes each rank's block from its counterpart in a live replica; another is hung in a step.
Every rank of every survivor must end with the bits of a replay of the ledger (the same per-step
member sets, no failure), and with its replica's other rank's ledger. Across namespace hosts:
tests/multihost/test_ft_hosts.py."""

from __future__ import annotations

import pytest

from tests.support.ft_run import Runs, assert_each_cross_group_aborted, check_replica_groups
from tests.support.processes import kill_tree, stop_tree

RANKS = 2


@pytest.fixture
def runs(tmp_path):
    runs = Runs(tmp_path)
    yield runs
    runs.close()


def test_a_replica_of_two_ranks_is_killed_rejoins_and_every_rank_takes_its_own_block(runs):
    steps, killed_at, rejoined_at = 14, 6, 10
    run = runs(3)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica_group(replica, steps, RANKS, holds=[killed_at] + ([rejoined_at] if replica != "r1" else []))
    run.wait_until(lambda: all(run.progress(r) == killed_at for r in ("r0", "r1", "r2")),
                   f"every replica to commit {killed_at} steps")
    kill_tree(run.processes["r1"].pid)  # mpiexec and both of r1's ranks
    run.processes["r1"].wait(30)
    run.gate(killed_at).touch()
    run.wait_until(lambda: run.progress("r0") == run.progress("r2") == rejoined_at,
                   f"r0 and r2 to commit step {rejoined_at} without r1")
    run.start_replica_group("r1", steps, RANKS)  # the same command again: a fresh job, weights zero, step 0
    run.wait_until(lambda: run.coordinator_said("join: r1"), "r1 to ask to join again")
    run.gate(rejoined_at).touch()
    members, _ = check_replica_groups(run, ["r0", "r1", "r2"], RANKS)
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
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica_group(replica, steps, RANKS, pauses=[hung_at])
    run.wait_until(lambda: all(run.progress(r) == hung_at for r in ("r0", "r1", "r2")),
                   f"every replica to commit {hung_at} steps")
    stop_tree(run.processes["r1"].pid)
    run.gate(hung_at).touch()  # r0 and r2 go on into a step with r1, which never answers
    try:
        members, results = check_replica_groups(run, ["r0", "r2"], RANKS)
    finally:
        kill_tree(run.processes["r1"].pid)
    assert members == [3] * hung_at + [2] * (steps - hung_at), members
    assert_each_cross_group_aborted(results, ["r0", "r2"], RANKS)
    assert run.coordinator_said("lost r1 (no heartbeat"), run.logs()
