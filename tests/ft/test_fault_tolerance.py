"""Fault-tolerant data parallelism with real processes: a coordinator (``python -m
commlib.ft.coordinator``) and replicas (tests/ft/fault_tolerance_ranks.py) that train, die by SIGKILL, join
late, or lose their coordinator; the survivors must end bitwise where a replay of their ledger
(the same per-step member sets, without any failure) ends, and every sample must have been
trained at most once per data pass (exactly once for a finished pass, less the counted drops).

The soak variants (``-m soak``) repeat each scenario with random failure steps and points and
report the counts. Heartbeat timeouts here are generous (a 2-core machine shared by many jobs
stalls processes for seconds): a replica wrongly taken for lost is only a membership change,
which the checks cover like any other.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import ft_training
from tests.support.ft_run import RESTART_GRACE, check_run, check_timeline, recovery_seconds
from tests.support.ft_scenarios import (play_at_random, scenario_kill_and_join, scenario_source_killed_during_catch_up,
                                        soak)


def test_a_jobs_life(run_factory):
    """One run through every failure of the default suite: r1 is SIGKILLed before its forward of
    step 2 (its peers' allreduce fails at once), r3 joins and catches up from a live peer, the
    coordinator is killed and restarted (the replicas train on meanwhile), and r2 is SIGKILLed
    at step 10 after its allreduce finished everywhere but before it voted."""
    steps = 12
    run = run_factory(3)
    run.start_coordinator()
    run.start_replica("r0", steps, holds=[4, 8])
    run.start_replica("r1", steps, die_at="2:forward", holds=[4, 8])
    run.start_replica("r2", steps, die_at="10:allreduce", holds=[4, 8])
    run.wait("r1")
    run.start_replica("r3", steps, holds=[8])
    run.wait_until(run.ready("r3").exists, "the joiner to start")
    run.gate(4).touch()
    run.wait_until(lambda: run.progress("r0") >= 6, "r0 to commit 6 steps")
    run.kill_coordinator()
    run.start_coordinator(grace=RESTART_GRACE)
    run.wait_until(lambda: run.coordinator_said("closed: coordinator restarted"),
                   "the restarted coordinator to end the epoch")
    run.gate(8).touch()
    summary = check_run(run, ["r0", "r3"], steps, {"r1": 2, "r2": 10})
    results = {replica: torch.load(run.result_path(replica), weights_only=False) for replica in ("r0", "r3")}
    caught_up = [event for event in results["r3"]["events"] if event["kind"] == "caught-up"]
    assert caught_up and caught_up[0]["bytes"] > 0 and caught_up[0]["steps"] >= 3, results["r3"]["events"][:5]
    assert any(event["kind"] == "quorum" and event["reason"] == "coordinator restarted"
               for event in results["r0"]["events"]), "the restarted coordinator formed a quorum of its own"
    assert summary["members_per_step"][2] == 2  # step 2 was redone without r1
    check_timeline(run, ["r0", "r3"], steps, summary)
    for victim, died_at in (("r1", 2), ("r2", 10)):
        seconds = recovery_seconds(run, victim, died_at, results["r0"]["events"])
        print(f"{victim} SIGKILLed at step {died_at} -> step committed without it {seconds:.2f} s later", flush=True)


def test_diloco_rounds_go_on_when_a_replica_dies_in_one_and_a_joiner_takes_the_outer_state(run_factory):
    """ddp.FaultTolerantDiLoCo, 3 inner steps a round: r1 is SIGKILLed in the middle of round 2's
    inner steps; nothing crosses the network before the round's average, which fails for the
    others, so the round is discarded (parameters and inner optimizer back to its start) and
    redone by r0 and r2; r3 joins and takes the parameters, the outer momentum and the data
    position. The survivors end bitwise where a failure-free DiLoCo replay of the ledger ends."""
    summary = scenario_kill_and_join(run_factory, 2, "forward", steps=6, diloco=3)
    members = summary["members_per_step"]
    assert members[:2] == [3, 3] and members[2] == 2 and members[-1] == 3, members
    assert summary["global_batch_per_step"][0] == 3 * 3 * ft_training.BATCH_SIZE  # a round: 3 inner batches


def test_torch_ddp_with_the_manager_hook_loses_a_replica_and_takes_a_joiner(run_factory):
    """torch's DistributedDataParallel (ddp.fault_tolerant_torch_ddp, the buckets averaged over
    the quorum by ddp.manager_comm_hook) on r0 and r1, our DDP with the same hook
    (ddp.fault_tolerant_ddp) on r2 and r3: r1 is SIGKILLed before its forward of step 2, r0 and
    r2 redo it, r3 joins and catches up, and its first iteration (our DDP's first bucket layout)
    meets the members' later ones (the layouts torch and ours rebuilt). The survivors end bitwise
    where the one-buffer replay ends, with quorums of three."""
    summary = scenario_kill_and_join(run_factory, 2, "forward", steps=8,
                                     options=["--torch-ddp", "--our-ddp-replicas=r2,r3"])
    members = summary["members_per_step"]
    assert members[:2] == [3, 3] and members[2] == 2 and members[-1] == 3, members


def test_a_source_killed_while_a_joiner_takes_its_state(run_factory):
    """The joiner's transfer fails at once (the source's connection closed), it loads nothing,
    and the next quorum's catch-up from another live member brings it the state."""
    summary = scenario_source_killed_during_catch_up(run_factory)
    assert summary["members_per_step"][0] == 3 and summary["members_per_step"][-1] == 3


@pytest.mark.soak
@pytest.mark.parametrize("scenario", ["kill_and_join", "kill_and_join_diloco", "kill_and_join_torch_ddp", "two_at_once",
                                      "coordinator_restart", "source_killed_during_catch_up"])
def test_soak(run_factory, scenario):
    soak(scenario, run_factory, lambda rng: play_at_random(run_factory, scenario, rng))
