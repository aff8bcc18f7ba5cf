"""The fault-tolerance scenarios the tests play, on this host or on namespaced hosts (whatever
``run_factory`` places them on: :class:`tests.support.ft_run.Runs`), and the soak that repeats
one of them at random steps. Each scenario returns :func:`tests.support.ft_run.check_run`'s
summary after every check of the run held.
"""

from __future__ import annotations

import os
import random
import time
from typing import Callable, Sequence

import torch

from tests.support import ft_training
from tests.support.ft_run import RESTART_GRACE, Runs, check_run

__all__ = ["scenario_kill_and_join", "scenario_two_at_once", "scenario_coordinator_restart",
           "scenario_source_killed_during_catch_up", "play_at_random", "soak", "SOAK_REPETITIONS"]

# scripts/ft_soak.sh sets these: more runs, or other random choices than the default seed's
SOAK_REPETITIONS = int(os.environ.get("FT_SOAK_REPETITIONS", "10"))
SOAK_SEED = os.environ.get("FT_SOAK_SEED", "")


def scenario_kill_and_join(run_factory: Runs, die_step: int, point: str, steps: int = 12, diloco: int = 0,
                           options: Sequence[str] = (), ranks: int = 1) -> dict:
    """r1 is SIGKILLed at ``die_step`` (``point``), a fresh r3 joins. With ``diloco=H`` a step is
    a round of H inner steps of ddp.FaultTolerantDiLoCo ("forward": in the middle of them);
    ``options`` go to every replica; ``ranks`` > 1: replicas of that many ranks (its own mpiexec
    job each, data parallel inside; r1's local rank 0 is killed, and with it the job)."""
    run = run_factory(3)
    run.start_coordinator()
    options = [*options, *(["--diloco", str(diloco)] if diloco else [])]
    # The survivors hold before step die_step + 2 until the joiner heartbeats, so that it joins
    # a running job (on a loaded machine a start-up can take longer than the whole run).
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, steps, die_at=f"{die_step}:{point}" if replica == "r1" else "",
                          holds=[die_step + 2], options=options, ranks=ranks)
    run.wait("r1")
    run.start_replica("r3", steps, options=options, ranks=ranks)  # a fresh replica joins once the victim is gone
    run.wait_until(run.ready("r3").exists, "the joiner to start")
    run.gate(die_step + 2).touch()
    if diloco:
        return check_run(run, ["r0", "r2", "r3"], steps, {"r1": die_step},
                         lambda ledger: ft_training.replay_diloco(ledger, diloco, local_size=ranks))
    return check_run(run, ["r0", "r2", "r3"], steps, {"r1": die_step},
                     lambda ledger: ft_training.replay(ledger, local_size=ranks))


def scenario_two_at_once(run_factory: Runs, die_step: int, point: str, steps: int = 8) -> dict:
    """r1 and r2 SIGKILLed at the same step and point; r0 and r3 train on."""
    run = run_factory(4)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2", "r3"):
        run.start_replica(replica, steps, die_at=f"{die_step}:{point}" if replica in ("r1", "r2") else "")
    return check_run(run, ["r0", "r3"], steps, {"r1": die_step, "r2": die_step})


def scenario_coordinator_restart(run_factory: Runs, kill_after: int, steps: int = 10) -> dict:
    """The coordinator SIGKILLed once r0 committed ``kill_after`` steps, started again a second
    later on the same address; nobody is lost."""
    run = run_factory(3)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, steps)
    run.wait_until(lambda: run.progress("r0") >= kill_after, f"r0 to commit {kill_after} steps")
    run.kill_coordinator()
    time.sleep(1.0)
    run.start_coordinator(grace=RESTART_GRACE)
    return check_run(run, ["r0", "r1", "r2"], steps, {})


def scenario_source_killed_during_catch_up(run_factory: Runs, steps: int = 8, join_at: int = 3, chunk: int = 1) -> dict:
    """r3 joins before step ``join_at``; r0, the lowest of the most advanced members, is the
    source of its catch-up and is SIGKILLed once it has sent chunk ``chunk`` (from 0) of its
    32 MiB state (five chunks with the model's)."""
    run = run_factory(3)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, steps, die_at="*:catchup" if replica == "r0" else "", holds=[join_at],
                          ballast_mib=32, options=[f"--die-chunk={chunk}"])
    # r3 must join a running job: started before the first quorum is out, it would be in it.
    run.wait_until(lambda: run.coordinator_said("epoch 0: members r0,r1,r2"), "the first quorum")
    run.start_replica("r3", steps, ballast_mib=32)
    run.wait_until(run.ready("r3").exists, "the joiner to start")
    run.gate(join_at).touch()
    run.wait("r0")
    summary = check_run(run, ["r1", "r2", "r3"], steps, {"r0": run.died_at("r0")})
    events = torch.load(run.result_path("r3"), weights_only=False)["events"]
    kinds = [event["kind"] for event in events]
    failed = [event for event in events if event["kind"] == "enter-failed"]
    # mid-transfer: a chunk's receive from the source (rank 0 of that quorum) ended with its exit
    assert failed and "from rank 0" in failed[0]["error"] and "exited" in failed[0]["error"], failed
    assert any(event["kind"] == "caught-up" and event["bytes"] > 32 << 20 for event in events), kinds
    assert kinds.index("enter-failed") < kinds.index("caught-up"), kinds  # the failed transfer came first
    return summary


def play_at_random(run_factory: Runs, scenario: str, rng: random.Random) -> tuple:
    """One run of ``scenario`` at random steps and points; returns them with the members per step."""
    if scenario == "coordinator_restart":
        kill_after = rng.randrange(1, 9)
        return kill_after, scenario_coordinator_restart(run_factory, kill_after)["members_per_step"]
    if scenario == "source_killed_during_catch_up":
        join_at, chunk = rng.randrange(1, 6), rng.randrange(0, 4)
        summary = scenario_source_killed_during_catch_up(run_factory, join_at=join_at, chunk=chunk)
        return join_at, chunk, summary["members_per_step"]
    diloco = scenario == "kill_and_join_diloco"
    # The survivors hold at die_step + 2 for the joiner, whose epoch starts after the next step:
    # at least one step must be left then (DiLoCo: 6 rounds, so die at round 2 at most).
    die_step, point = rng.randrange(0, 3 if diloco else 7), rng.choice(["forward", "allreduce"])
    if diloco:
        summary = scenario_kill_and_join(run_factory, die_step, point, steps=6, diloco=3)
    elif scenario == "kill_and_join_torch_ddp":
        summary = scenario_kill_and_join(run_factory, die_step, point, options=["--torch-ddp"])
    elif scenario == "kill_and_join":
        summary = scenario_kill_and_join(run_factory, die_step, point)
    elif scenario == "two_at_once":
        summary = scenario_two_at_once(run_factory, die_step, point)
    else:
        raise ValueError(f"no scenario {scenario!r}")
    return die_step, point, summary["members_per_step"]


def soak(name: str, run_factory: Runs, play: Callable[[random.Random], tuple]) -> None:
    """``play`` SOAK_REPETITIONS times with one seeded generator (a failing run is found again by
    its name and SOAK_SEED), printing each run's random choices and members per step, then the count. What a
    run left running (its coordinator) is killed before the next starts."""
    rng = random.Random(f"soak-{name}{SOAK_SEED}")
    outcomes = []
    for repetition in range(SOAK_REPETITIONS):
        outcomes.append(play(rng))
        run_factory.close()
        print(f"soak {name} {repetition + 1}/{SOAK_REPETITIONS} passed: {outcomes[-1]}", flush=True)
    print(f"soak {name}: {len(outcomes)}/{SOAK_REPETITIONS} runs passed every check", flush=True)
