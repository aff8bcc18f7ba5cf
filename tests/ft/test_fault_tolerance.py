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

import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
import torch

from tests.support import ft_training
from tests.support.launch import ROOT, base_env, free_port, kill_tree

REPLICA = ROOT / "tests" / "ft" / "fault_tolerance_ranks.py"
HEARTBEAT_TIMEOUT = 4.0
# A restarted coordinator listens this long before it forms a quorum: the replicas reconnect
# within a heartbeat interval (0.1 s); one that is later joins at the next step boundary.
RESTART_GRACE = 2.0
RUN_TIMEOUT = 150.0


class Run:
    """One coordinator and its replicas, each a process with its output in a file."""

    def __init__(self, directory: Path, initial: int):
        self.directory = directory
        self.port = free_port()
        self.initial = initial
        self.processes: Dict[str, subprocess.Popen] = {}
        self.coordinator: Optional[subprocess.Popen] = None
        self.deadline = time.monotonic() + RUN_TIMEOUT
        self.env = base_env({"MPI4PY_RC_INITIALIZE": "0"})

    def _start(self, name: str, command: List[str]) -> subprocess.Popen:
        log = open(self.directory / f"{name}.log", "a")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=str(ROOT),
                                   start_new_session=True)
        log.close()
        return process

    def start_coordinator(self, grace: float = 0.0) -> None:
        self.coordinator = self._start("coordinator", [
            sys.executable, "-m", "commlib.ft.coordinator", "--open", "--port", str(self.port),
            "--initial-replicas", str(self.initial), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
            "--grace", str(grace)])

    def kill_coordinator(self) -> None:
        assert self.coordinator is not None
        kill_tree(self.coordinator.pid)
        self.coordinator.wait(30)

    def start_replica(self, replica: str, steps: int, die_at: str = "", holds: Sequence[int] = (),
                      ballast_mib: int = 0) -> None:
        """``holds``: steps before which the replica waits for :meth:`gate` of that step."""
        self.processes[replica] = self._start(replica, [
            sys.executable, str(REPLICA), "--coordinator", f"127.0.0.1:{self.port}", "--id", replica,
            "--steps", str(steps), "--die-at", die_at, "--out", str(self.result_path(replica)),
            "--progress", str(self.directory / f"{replica}.progress"), "--ready", str(self.ready(replica)),
            "--ballast-mib", str(ballast_mib), *[f"--hold={step}:{self.gate(step)}" for step in holds]])

    def died_at(self, replica: str) -> int:
        """The step count the replica had when it killed itself."""
        return int((self.directory / f"{replica}.died-step").read_text())

    def ready(self, replica: str) -> Path:
        return self.directory / f"{replica}.ready"

    def gate(self, step: int) -> Path:
        return self.directory / f"gate-{step}"

    def coordinator_said(self, text: str) -> bool:
        return text in (self.directory / "coordinator.log").read_text()

    def result_path(self, replica: str) -> Path:
        return self.directory / f"{replica}.pt"

    def progress(self, replica: str) -> int:
        try:
            return int((self.directory / f"{replica}.progress").read_text() or 0)
        except (OSError, ValueError):
            return 0

    def wait_until(self, condition, what: str) -> None:
        while not condition():
            if time.monotonic() > self.deadline:
                self.fail(f"timed out waiting for {what}")
            time.sleep(0.05)

    def wait(self, replica: str) -> int:
        process = self.processes[replica]
        try:
            return process.wait(max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.fail(f"replica {replica} still running after {RUN_TIMEOUT:g} s")
        raise AssertionError("unreachable")

    def logs(self) -> str:
        return "\n".join(f"--- {path.name} ---\n{path.read_text()[-4000:]}"
                         for path in sorted(self.directory.glob("*.log")))

    def fail(self, message: str) -> None:
        self.close()
        pytest.fail(f"{message}\n{self.logs()}")

    def close(self) -> None:
        for process in [*self.processes.values(), self.coordinator]:
            if process is not None and process.poll() is None:
                kill_tree(process.pid)
                process.wait(30)


@pytest.fixture
def run_factory(tmp_path):
    runs: List[Run] = []

    def make(initial: int) -> Run:
        run = Run(tmp_path / f"run{len(runs)}", initial)
        run.directory.mkdir()
        runs.append(run)
        return run

    yield make
    for run in runs:
        run.close()


def check_run(run: Run, survivors: List[str], steps: int, victims: Dict[str, int]) -> dict:
    """Every check of a finished run; returns the survivors' summary."""
    codes = {replica: run.wait(replica) for replica in run.processes}
    for replica in survivors:
        if codes[replica] != 0:
            run.fail(f"survivor {replica} exited with {codes[replica]}")
    for replica in victims:
        if codes[replica] != -9:
            run.fail(f"victim {replica} exited with {codes[replica]}, expected SIGKILL")
    results = {replica: torch.load(run.result_path(replica), weights_only=False) for replica in survivors}
    first = results[survivors[0]]
    ledger = first["ledger"]
    problems = []
    for replica, result in results.items():
        if result["ledger"] != ledger:
            problems.append(f"{replica}'s ledger differs from {survivors[0]}'s")
    if len(ledger["steps"]) != steps:
        problems.append(f"{len(ledger['steps'])} committed steps, expected {steps}")
    # No step committed with a member that had died before it: a victim killed at step k never
    # voted for step k.
    for record in ledger["steps"]:
        for victim, died_at in victims.items():
            if victim in record["members"] and record["step"] >= died_at:
                problems.append(f"step {record['step']} committed with {victim}, killed at step {died_at}")
    # Every commit was with the full member set of its quorum, as the survivors saw it formed.
    quorums = {event["epoch"]: event["members"] for result in results.values() for event in result["events"]
               if event["kind"] == "quorum"}
    for record in ledger["steps"]:
        if record["epoch"] in quorums and record["members"] != quorums[record["epoch"]]:
            problems.append(f"step {record['step']}: members {record['members']} != quorum "
                            f"{quorums[record['epoch']]} of epoch {record['epoch']}")
    # Sample accounting: at most once per pass; a finished pass is whole (what was dropped, counted).
    counts = ft_training.sample_counts(ledger)
    last_pass = max(counts) if counts else 0
    for data_epoch, seen in counts.items():
        if seen.max() > 1:
            problems.append(f"data pass {data_epoch}: samples trained twice: {list((seen > 1).nonzero()[0])}")
        dropped = ledger["dropped"].get(str(data_epoch), 0)
        if data_epoch < last_pass and int(seen.sum()) + dropped != ft_training.DATASET_SIZE:
            problems.append(f"data pass {data_epoch}: {int(seen.sum())} trained + {dropped} dropped != "
                            f"{ft_training.DATASET_SIZE}")
    # Bitwise: survivors agree, and equal the failure-free replay of the ledger.
    reference = ft_training.replay(ledger)
    for replica, result in results.items():
        for index, (mine, expected) in enumerate(zip(result["params"], reference)):
            if not torch.equal(mine, expected):
                problems.append(f"{replica}: parameter {index} differs from the replay (max |diff| "
                                f"{(mine - expected).abs().max().item():.3g})")
    if problems:
        run.fail("\n".join(problems))
    summary = first["summary"]
    print(f"run summary: {summary['steps']} steps, {summary['replica_steps']} replica-steps, members per step "
          f"{summary['members_per_step']}, global batch {summary['global_batch_per_step']}", flush=True)
    return summary


def check_timeline(run: Run, survivors: List[str], steps: int, summary: dict) -> None:
    """``python -m commlib.ft.timeline`` on the survivors' events: the picture is drawn, and its
    tables say what the ledger and the events say."""
    from commlib.ft import timeline

    paths = [str(run.result_path(replica)).replace(".pt", ".events.json") for replica in survivors]
    events = timeline.load_events(paths)
    png = run.directory / "timeline.png"
    assert timeline.main([*paths, "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    per_step = timeline.members_per_step(events)
    assert len(per_step) == steps and [len(members) for members in per_step.values()] == summary["members_per_step"]
    epochs = sorted({event["epoch"] for event in events if event["kind"] == "quorum"})
    assert [quorum["epoch"] for quorum in timeline.quorums(events)] == epochs
    moved = timeline.transfers(events)
    assert [transfer["replica"] for transfer in moved] == ["r3"] and moved[0]["bytes"] > 0, moved
    assert moved[0]["epoch"] in epochs and moved[0]["seconds"] > 0, moved


def recovery_seconds(run: Run, victim: str, died_at: int, survivor_events: List[dict]) -> float:
    """From the victim's SIGKILL to the commit of the step it died in (wall clocks of one machine)."""
    died = float((run.directory / f"{victim}.died").read_text())
    return min(event["t"] for event in survivor_events if event["kind"] == "commit" and event["step"] >= died_at) - died


def scenario_kill_and_join(run_factory, die_step: int, point: str, steps: int = 12) -> dict:
    run = run_factory(3)
    run.start_coordinator()
    # The survivors hold before step die_step + 2 until the joiner heartbeats, so that it joins
    # a running job (on a loaded machine a start-up can take longer than the whole run).
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, steps, die_at=f"{die_step}:{point}" if replica == "r1" else "",
                          holds=[die_step + 2])
    run.wait("r1")
    run.start_replica("r3", steps)  # a fresh replica joins once the victim is gone
    run.wait_until(run.ready("r3").exists, "the joiner to start")
    run.gate(die_step + 2).touch()
    return check_run(run, ["r0", "r2", "r3"], steps, {"r1": die_step})


def scenario_two_at_once(run_factory, die_step: int, point: str, steps: int = 8) -> dict:
    run = run_factory(4)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2", "r3"):
        run.start_replica(replica, steps, die_at=f"{die_step}:{point}" if replica in ("r1", "r2") else "")
    return check_run(run, ["r0", "r3"], steps, {"r1": die_step, "r2": die_step})


def scenario_coordinator_restart(run_factory, kill_after: int, steps: int = 10) -> dict:
    run = run_factory(3)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, steps)
    run.wait_until(lambda: run.progress("r0") >= kill_after, f"r0 to commit {kill_after} steps")
    run.kill_coordinator()
    time.sleep(1.0)
    run.start_coordinator(grace=RESTART_GRACE)
    return check_run(run, ["r0", "r1", "r2"], steps, {})


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


def scenario_source_killed_during_catch_up(run_factory, steps: int = 8) -> dict:
    """r3 joins before step 3; r0, the lowest of the most advanced members, is the source of its
    catch-up and is SIGKILLed once it has sent two chunks of its 32 MiB state."""
    run = run_factory(3)
    run.start_coordinator()
    for replica in ("r0", "r1", "r2"):
        run.start_replica(replica, steps, die_at="*:catchup" if replica == "r0" else "", holds=[3], ballast_mib=32)
    run.wait_until(lambda: all(run.ready(replica).exists() for replica in ("r0", "r1", "r2")), "the replicas")
    run.start_replica("r3", steps, ballast_mib=32)
    run.wait_until(run.ready("r3").exists, "the joiner to start")
    run.gate(3).touch()
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


def test_a_source_killed_while_a_joiner_takes_its_state(run_factory):
    """The joiner's transfer fails at once (the source's connection closed), it loads nothing,
    and the next quorum's catch-up from another live member brings it the state."""
    summary = scenario_source_killed_during_catch_up(run_factory)
    assert summary["members_per_step"][0] == 3 and summary["members_per_step"][-1] == 3


@pytest.mark.soak
@pytest.mark.parametrize("scenario", ["kill_and_join", "two_at_once", "coordinator_restart"])
def test_soak(run_factory, scenario):
    rng = random.Random(f"soak-{scenario}")
    outcomes = []
    for repetition in range(10):
        if scenario == "coordinator_restart":
            kill_after = rng.randrange(1, 9)
            summary = scenario_coordinator_restart(run_factory, kill_after)
            outcomes.append((kill_after, summary["members_per_step"]))
        else:
            die_step, point = rng.randrange(0, 7), rng.choice(["forward", "allreduce"])
            play = scenario_kill_and_join if scenario == "kill_and_join" else scenario_two_at_once
            summary = play(run_factory, die_step, point)
            outcomes.append((die_step, point, summary["members_per_step"]))
        print(f"soak {scenario} {repetition + 1}/10 passed: {outcomes[-1]}", flush=True)
    print(f"soak {scenario}: {len(outcomes)}/10 runs passed every check", flush=True)
    assert len(outcomes) == 10
