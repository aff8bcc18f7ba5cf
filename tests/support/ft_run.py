"""Fault-tolerant runs for the tests: a coordinator (``python -m commlib.ft.coordinator``) and
replicas (tests/ft/fault_tolerance_ranks.py; replicas of several ranks: tests/ft/replica_group_ranks.py,
each its own mpiexec job), each a process with its output in a file, on this host or placed on
the hosts of a :class:`commlib.cluster.Cluster`; and every check of a finished run (ledgers,
commits, samples, bitwise equality with a failure-free replay of the ledger).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import pytest
import torch

from tests.support import ft_sharded, ft_training
from tests.support.launch import ROOT, base_env, free_port, kill_tree
from tests.support.mpirun import mpiexec_path

__all__ = ["Run", "Runs", "check_run", "check_replica_groups", "assert_each_cross_group_aborted", "check_timeline",
           "recovery_seconds", "assert_each_replica_s_ranks_agree", "HEARTBEAT_TIMEOUT",
           "RESTART_GRACE"]

REPLICA = ROOT / "tests" / "ft" / "fault_tolerance_ranks.py"
REPLICA_GROUP = ROOT / "tests" / "ft" / "replica_group_ranks.py"
HEARTBEAT_TIMEOUT = 4.0
# A restarted coordinator listens this long before it forms a quorum: the replicas reconnect
# within a heartbeat interval (0.1 s); one that is later joins at the next step boundary.
RESTART_GRACE = 2.0
RUN_TIMEOUT = 150.0
MPIEXEC_RANK_KILLED = 9  # what mpiexec (hydra) exits with when a rank of its job died of SIGKILL


class Run:
    """One coordinator and its replicas, each a process with its output in a file.

    With ``cluster``, each runs on a host of it: the coordinator on ``hosts["coordinator"]``, a
    replica on ``hosts[replica]`` (default: the first host), its groups on the hosts' links."""

    def __init__(self, directory: Path, initial: int, *, cluster=None, hosts: Optional[Dict[str, str]] = None,
                 heartbeat_timeout: float = HEARTBEAT_TIMEOUT, run_timeout: float = RUN_TIMEOUT):
        self.directory = directory
        self.port = free_port()
        self.initial = initial
        self.cluster, self.hosts = cluster, dict(hosts or {})
        self.heartbeat_timeout = heartbeat_timeout
        self.processes: Dict[str, subprocess.Popen] = {}
        self.ranks: Dict[str, int] = {}  # of the replicas started by start_replica
        self.coordinator: Optional[subprocess.Popen] = None
        self.run_timeout = run_timeout
        self.deadline = time.monotonic() + run_timeout
        self.env = base_env({"MPI4PY_RC_INITIALIZE": "0"})
        self.address = "127.0.0.1"
        if cluster is not None:
            self.env["COMMLIB_SOCKET_IFNAME"] = "eth0"  # the hosts' link
            self.address = cluster.state.host(self.host_of("coordinator")).address

    def host_of(self, name: str) -> str:
        return self.hosts.get(name, "h0")

    def _start(self, name: str, command: List[str]) -> subprocess.Popen:
        log = open(self.directory / f"{name}.log", "a")
        if self.cluster is not None:
            process = self.cluster.popen(self.host_of(name), command, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=str(ROOT), start_new_session=True)
        else:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=str(ROOT),
                                       start_new_session=True)
        log.close()
        return process

    def start_coordinator(self, grace: float = 0.0, slow_probation: float = 30.0) -> None:
        self.coordinator = self._start("coordinator", [
            sys.executable, "-m", "commlib.ft.coordinator", "--open", "--host", self.address, "--port", str(self.port),
            "--initial-replicas", str(self.initial), "--heartbeat-timeout", str(self.heartbeat_timeout),
            "--grace", str(grace), "--slow-probation", str(slow_probation)])

    def kill_coordinator(self) -> None:
        assert self.coordinator is not None
        kill_tree(self.coordinator.pid)
        self.coordinator.wait(30)

    def start_replica(self, replica: str, steps: int, die_at: str = "", holds: Sequence[int] = (),
                      ballast_mib: int = 0, pauses: Sequence[int] = (), options: Sequence[str] = (),
                      ranks: int = 1) -> None:
        """``holds``: steps before which the replica waits for :meth:`gate` of that step and for
        its epoch to close (for a joiner, or a restarted coordinator); ``pauses``: for the gate only;
        ``options``: more of the replica script's flags. ``ranks`` > 1: a replica of that many
        ranks, data parallel inside (``mpiexec -n ranks ... --local``)."""
        self.ranks[replica] = ranks
        launcher = self._mpiexec(ranks) if ranks > 1 else []
        if ranks > 1:
            options = [*options, "--local"]
        self.processes[replica] = self._start(replica, [
            *launcher, sys.executable, str(REPLICA), "--coordinator", f"{self.address}:{self.port}", "--id", replica,
            "--steps", str(steps), "--die-at", die_at, "--out", str(self.result_path(replica)),
            "--progress", str(self.directory / f"{replica}.progress"), "--ready", str(self.ready(replica)),
            "--ballast-mib", str(ballast_mib), *[f"--hold={step}:{self.gate(step)}" for step in holds],
            *[f"--pause={step}:{self.gate(step)}" for step in pauses], *options])

    def start_replica_group(self, replica: str, steps: int, ranks: int, holds: Sequence[int] = (),
                            pauses: Sequence[int] = ()) -> None:
        """A replica of ``ranks`` ranks: ``mpiexec -n ranks`` of tests/ft/replica_group_ranks.py
        (on its host, with a cluster); ``holds`` and ``pauses`` as in :meth:`start_replica`."""
        self.processes[replica] = self._start(replica, [
            *self._mpiexec(ranks), sys.executable, str(REPLICA_GROUP), "--coordinator",
            f"{self.address}:{self.port}", "--id", replica, "--steps", str(steps), "--out", str(self.directory),
            *[f"--hold={step}:{self.gate(step)}" for step in holds],
            *[f"--pause={step}:{self.gate(step)}" for step in pauses]])

    def _mpiexec(self, ranks: int) -> List[str]:
        """The launcher of a replica of several ranks (an MPI job: MPI starts with it)."""
        self.env.pop("MPI4PY_RC_INITIALIZE", None)
        return [mpiexec_path(), "-n", str(ranks)]

    def died_at(self, replica: str) -> int:
        """The step count the replica had when it killed itself."""
        return int((self.directory / f"{replica}.died-step").read_text())

    def ready(self, replica: str) -> Path:
        return self.directory / f"{replica}.ready"

    def gate(self, step: int) -> Path:
        return self.directory / f"gate-{step}"

    def coordinator_said(self, text: str, times: int = 1) -> bool:
        return (self.directory / "coordinator.log").read_text().count(text) >= times

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
            self.fail(f"replica {replica} still running after {self.run_timeout:g} s")
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


class Runs:
    """Makes the runs of a test, each in a directory of its own under ``directory``; ``close``
    kills whatever of theirs still runs (a test's fixture calls it)."""

    def __init__(self, directory: Path, **options):
        self.directory, self.options = directory, options
        self.runs: List[Run] = []

    def __call__(self, initial: int, **options) -> Run:
        run = Run(self.directory / f"run{len(self.runs)}", initial, **{**self.options, **options})
        run.directory.mkdir()
        self.runs.append(run)
        return run

    def close(self) -> None:
        for run in self.runs:
            run.close()


def check_run(run: Run, survivors: List[str], steps: int, victims: Dict[str, int],
              replay: Callable[[dict], List[torch.Tensor]] = ft_training.replay,
              failures: Optional[int] = None) -> dict:
    """Every check of a finished run; returns the survivors' summary. ``replay``: the
    failure-free training of a ledger that the survivors' parameters must equal bitwise;
    ``failures``: how many the run had (default: one per victim), each allowed one redone step."""
    codes = {replica: run.wait(replica) for replica in run.processes}
    for replica in survivors:
        if codes[replica] != 0:
            run.fail(f"survivor {replica} exited with {codes[replica]}")
    for replica in victims:
        # (a replica of several ranks: mpiexec's exit status for a job one of whose ranks was SIGKILLed)
        killed = -9 if run.ranks.get(replica, 1) == 1 else MPIEXEC_RANK_KILLED
        if codes[replica] != killed:
            run.fail(f"victim {replica} exited with {codes[replica]}, expected {killed} (SIGKILL)")
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
    # At most one step redone per failure: a survivor's step that did not commit is redone.
    allowed = len(victims) if failures is None else failures
    for replica, result in results.items():
        redone = [event["step"] for event in result["events"] if event["kind"] in ("abort", "outcome-unknown")]
        if len(redone) > allowed:
            problems.append(f"{replica} redid {len(redone)} steps ({redone}) for {allowed} failures")
    # Sample accounting: at most once per pass; a finished pass is whole (what was dropped, counted).
    # (Without configure_data the ledger counts no samples: every step's global batch is 0.)
    counts = ft_training.sample_counts(ledger)
    if not ledger["dataset_size"] and any(record["global_batch"] for record in ledger["steps"]):
        problems.append(f"no sample accounting, yet global batches {[r['global_batch'] for r in ledger['steps']]}")
    last_pass = max(counts) if counts else 0
    for data_epoch, seen in counts.items():
        if seen.max() > 1:
            problems.append(f"data pass {data_epoch}: samples trained twice: {list((seen > 1).nonzero()[0])}")
        dropped = ledger["dropped"].get(str(data_epoch), 0)
        if data_epoch < last_pass and int(seen.sum()) + dropped != ft_training.DATASET_SIZE:
            problems.append(f"data pass {data_epoch}: {int(seen.sum())} trained + {dropped} dropped != "
                            f"{ft_training.DATASET_SIZE}")
    # Bitwise: survivors agree, and equal the failure-free replay of the ledger.
    reference = replay(ledger)
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


def check_replica_groups(run: Run, survivors: List[str], ranks: int) -> tuple:
    """Wait for the ``survivors`` (replicas of ``ranks`` ranks); check that every rank of each
    holds the first one's ledger and local rank ``j``'s weights bitwise equal to the replay's
    block ``j``. Returns the members per committed step and every rank's result."""
    for replica in survivors:
        if run.wait(replica) != 0:
            run.fail(f"{replica} exited with {run.processes[replica].returncode}")
    results = {replica: [json.loads((run.directory / f"{replica}.{rank}.json").read_text()) for rank in range(ranks)]
               for replica in survivors}
    ledger = results[survivors[0]][0]["ledger"]
    expected = ft_sharded.replay(ledger, ranks)
    for replica, per_rank in results.items():
        for rank, result in enumerate(per_rank):
            assert result["ledger"] == ledger, f"{replica} rank {rank}: another ledger"
            weights = np.frombuffer(bytes.fromhex(result["weights"]), np.float64)
            assert weights.tobytes() == expected[rank].tobytes(), (
                f"{replica} rank {rank}: {weights} vs the replay's {expected[rank]}")
    assert not np.array_equal(expected[0], expected[1]), "the blocks should differ (else the check shows less)"
    return [len(step["members"]) for step in ledger["steps"]], results


def assert_each_cross_group_aborted(results: dict, replicas: List[str], ranks: int) -> None:
    """In each cross-replica group (local rank ``j`` of ``replicas``; for ``j`` > 0 none of them a
    leader) some member aborted the group when the coordinator closed the epoch as lost (its
    abort then reaches the others): a group left to its timeout has no such event."""
    for rank in range(ranks):
        events = {replica: results[replica][rank]["events"] for replica in replicas}
        assert any("group-aborted" in kinds for kinds in events.values()), f"local rank {rank}: {events}"


def assert_each_replica_s_ranks_agree(directory, pattern: str) -> None:
    """Every replica's rank 1 (``<id>.rank1.pt``) ends with its rank 0's parameters, bit for bit."""
    results = sorted(directory.glob(pattern))
    assert results, f"no results {pattern} in {directory}"
    for result in results:
        ours = torch.load(result, weights_only=False)["params"]
        theirs = torch.load(result.with_name(result.stem + ".rank1.pt"), weights_only=False)["params"]
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), f"{result.stem}: its ranks differ"
