"""Replicas of several ranks (``commlib.ft.Manager(local_group=...)``) on this host, each its own
mpiexec job of two ranks (tests/ft/replica_group_ranks.py: a model split by features across the
ranks, the parts of each prediction summed over MPI, each rank's block averaged with its
counterparts over sockets). One replica's whole job is SIGKILLed and started again later: it
takes each rank's block from its counterpart in a live replica; another is hung in a step.
Every rank of every survivor must end with the bits of a replay of the ledger (the same per-step
member sets, no failure), and with its replica's other rank's ledger.

Then replicas of two ranks training one torch model data parallel inside
(tests/ft/fault_tolerance_ranks.py ``--local``: each rank on its part of the replica's share,
averaged over the replica, then across the quorum), with each DDP and with DiLoCo, through a
death, a joiner and a coordinator restart: every rank of every survivor bitwise equal to the
replay with that split. Across namespace hosts: tests/multihost/test_ft_hosts.py."""

from __future__ import annotations

import time

import torch

from tests.support import ft_training
from tests.support.ft_run import (RESTART_GRACE, assert_each_cross_group_aborted, assert_each_replica_s_ranks_agree,
                                  check_replica_groups, check_run)
from tests.support.ft_scenarios import scenario_kill_and_join
from tests.support.processes import kill_tree, stop_tree

RANKS = 2


def test_a_replica_of_two_ranks_is_killed_rejoins_and_every_rank_takes_its_own_block(run_factory):
    steps, killed_at, rejoined_at = 14, 6, 10
    run = run_factory(3)
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


def test_a_hung_replica_of_two_ranks_is_dropped_by_every_rank_of_the_others(run_factory):
    """r1's job stopped (SIGSTOP: alive, its sockets open, silent) while r0 and r2 are in a step
    with it: the coordinator misses its heartbeats and closes the epoch as lost; the ranks of r0
    and r2, local rank 1 too, watch for that and abort their own cross-replica groups (else local
    rank 1 would wait for r1's local rank 1 until the group's timeout), and the step is redone
    without r1."""
    steps, hung_at = 12, 5
    run = run_factory(3)
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


def test_each_ddp_on_replicas_of_two_ranks_loses_one_and_takes_a_joiner(run_factory):
    """Data parallel inside each replica too (two ranks, each on its part of the replica's
    share, averaged inside the replica, then across the quorum): torch's DDP over the "commlib"
    backend with the manager's hook on r0 and r1, FaultTolerantDDP on r2, our DDP with the hook
    on the joiner r3. Shares of 19 samples split 10 and 9; the data pass ends after one step
    (3 samples left: shares of 1, split 1 and 0, an empty part). Survivors bitwise equal to the
    replay, and each replica's other rank holds the same parameters as its rank 0."""
    summary = scenario_kill_and_join(run_factory, 3, "forward", steps=9, ranks=2,
                                     options=["--torch-ddp-replicas=r0,r1", "--our-ddp-replicas=r3",
                                              "--batch-size=19"])
    assert summary["members_per_step"][:3] == [3, 3, 3], summary
    assert summary["global_batch_per_step"][:3] == [57, 3, 57], summary  # the second step: empty parts
    assert_each_replica_s_ranks_agree(run_factory.runs[0].directory, "r[023].pt")


def test_diloco_on_replicas_of_two_ranks_loses_one_in_a_round_and_takes_a_joiner(run_factory):
    """DiLoCo with replicas of two ranks, data parallel inside, the gradients averaged over the
    replica before each inner step: the first round's inner batches of 5 samples split 3 and 2;
    the second round ends the data pass (15 samples left: shares of 5, inner batches of 2, 2
    and 1), so its last batch splits 1 and 0, an empty part. r1's rank 0 dies in the middle of
    the third round; survivors bitwise equal to the replay with that split, and each replica's
    rank 1 equal to its rank 0."""
    summary = scenario_kill_and_join(run_factory, 2, "forward", steps=6, diloco=3, ranks=2,
                                     options=["--batch-size=5"])
    assert summary["members_per_step"][:2] == [3, 3], summary
    assert summary["global_batch_per_step"][:2] == [45, 15], summary  # the second round: the empty part
    assert_each_replica_s_ranks_agree(run_factory.runs[0].directory, "r[023].pt")


def test_replicas_of_two_ranks_wait_out_a_coordinator_restart_while_one_of_them_dies(run_factory):
    """Replicas of two ranks; the coordinator is killed, and then r1's rank 0 (with it r1's job)
    before its forward of step 4. The survivors' step fails and their leaders wait for a
    coordinator while their other ranks wait on them in the replica's group; the restarted
    coordinator forms a quorum of r0 and r2, on every rank of them. The training chooses its own
    data here (no sample accounting, ``--own-data``: parts of 3 and 5 samples), so the manager
    averages a replica's ranks plainly: bitwise equal to ``ft_training.replay_own_data``."""
    steps = 8
    run = run_factory(3)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, steps, die_at="4:forward" if replica == "r1" else "", pauses=[4], ranks=2,
                          options=["--own-data"])
    run.wait_until(lambda: all(run.progress(replica) >= 4 for replica in ("r0", "r1", "r2")),
                   "every replica to commit 4 steps")
    run.kill_coordinator()
    run.gate(4).touch()
    run.wait("r1")
    time.sleep(1.0)
    run.start_coordinator(grace=RESTART_GRACE)
    summary = check_run(run, ["r0", "r2"], steps, {"r1": 4}, lambda ledger: ft_training.replay_own_data(ledger, 2))
    assert summary["members_per_step"] == [3, 3, 3, 3, 2, 2, 2, 2], summary
    assert summary["global_batch_per_step"] == [0] * steps, summary  # no sample accounting
    for result in ("r0.pt", "r0.rank1.pt", "r2.pt", "r2.rank1.pt"):
        kinds = [(event["kind"], event.get("reason"), event.get("members"))
                 for event in torch.load(run.directory / result, weights_only=False)["events"]]
        lost = kinds.index(("coordinator-lost", None, None))
        assert ("quorum", "coordinator restarted", ["r0", "r2"]) in kinds[lost:], f"{result}: {kinds}"
    assert_each_replica_s_ranks_agree(run.directory, "r[02].pt")
