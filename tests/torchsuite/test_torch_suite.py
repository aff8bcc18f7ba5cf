"""torch's own distributed suite (``DistributedTest``, under torch's spawning harness) on the
"commlib" backend, as the runner in this folder drives it.

In the default suite: a sample of it on commlib at world size 2 (a dozen: collectives with
torch's profiler checks, coalesced forms, rooted ones, barrier, groups, an object collective,
sparse allreduce, point-to-point, torch's DDP, with a comm hook and no_sync); every one must pass. (The suite has
no uneven-inputs join test that runs without GPUs.)

With ``-m torchsuite`` (long: every test on both backends): the whole suite on gloo and on
commlib at world sizes 2 and 3, compared test by test: each test that passes on gloo must pass
on commlib unless :data:`tests.torchsuite.compare.EXCEPTIONS` lists it with its reason; and the
runner's own deadline (a test that outlives it is recorded as a timeout, its worker killed and
restarted for the next test).

    python -m pytest tests/torchsuite -m torchsuite      # the JSONs stay in $TMPDIR/commlib-torchsuite

"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.mpirun import child_environment
from tests.torchsuite import compare

pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]

SAMPLE = (
    "test_all_reduce_sum",                 # + torch's profiler: one async commlib:all_reduce per call
    "test_all_reduce_coalesced_sum",
    "test_broadcast",
    "test_all_gather_coalesced_simple",
    "test_gather",
    "test_send_recv",                      # point-to-point, each rank to every other
    "test_barrier",
    "test_destroy_group",                  # new_group / destroy_process_group
    "test_all_gather_object_subgroup",     # an object collective on a subgroup
    "test_sparse_all_reduce_sum",
    "test_DistributedDataParallelCPU",
    "test_accumulate_gradients_no_sync_allreduce_hook",
)


def run_suite(backend: str, world_size: int, out: Path, *options: str, timeout: float) -> dict:
    command = [sys.executable, "-m", "tests.torchsuite.run_torch_suite", "--backend", backend,
               "--world-size", str(world_size), "--out", str(out), *options]
    finished = subprocess.run(command, cwd=str(ROOT), env=child_environment(), capture_output=True, text=True,
                              timeout=timeout)
    output = f"{finished.stdout}\n{finished.stderr[-4000:]}"
    assert finished.returncode == 0, f"{' '.join(command)} exited {finished.returncode}:\n{output}"
    return json.loads(out.read_text())


def not_passed(run: dict) -> dict:
    return {name: outcome for name, outcome in run["tests"].items() if outcome["outcome"] != "passed"}


def test_sample_of_torch_s_suite_passes_on_commlib(tmp_path):
    run = run_suite("commlib", 2, tmp_path / "sample.json", "--tests", ",".join(SAMPLE), "--quiet",
                    "--test-timeout", "120", "--grace", "30", timeout=600)
    assert sorted(run["tests"]) == sorted(SAMPLE)
    assert not not_passed(run), json.dumps(not_passed(run), indent=1)


def _full_runs_selected(config) -> bool:
    return "torchsuite" in (config.getoption("markexpr") or "")


@pytest.fixture
def full_runs(request):
    if not _full_runs_selected(request.config):
        pytest.skip("the whole suite runs with -m torchsuite")
    # Kept between sessions: a stopped run resumes where it was.
    folder = Path(tempfile.gettempdir()) / "commlib-torchsuite"
    folder.mkdir(exist_ok=True)
    return folder


@pytest.mark.torchsuite
@pytest.mark.timeout(7200)
@pytest.mark.parametrize("world_size", (2, 3))
def test_every_test_passing_on_gloo_passes_on_commlib(full_runs, world_size):
    runs = {backend: run_suite(backend, world_size, full_runs / f"{backend}-p{world_size}.json", "--quiet",
                               "--test-timeout", "180", "--grace", "60", timeout=7000)
            for backend in ("gloo", "commlib")}
    print(compare.table(list(runs.values())))
    unexplained = [entry for entry in compare.regressions(runs["gloo"], runs["commlib"]) if not entry[3]]
    assert not unexplained, "\n".join(f"{name}: {outcome}: {cause}" for name, outcome, cause, _ in unexplained)


@pytest.mark.torchsuite
def test_a_test_past_its_deadline_is_a_timeout_and_the_next_one_runs(full_runs, tmp_path):
    # A deadline of 0 s: the runner kills the worker (ranks included) at its first look after a
    # test started (within ~0.2 s; each test takes seconds) and records a timeout; the second
    # test is recorded too, so a fresh worker started it.
    names = ("test_DistributedDataParallelCPU", "test_accumulate_gradients_no_sync")
    run = run_suite("commlib", 2, tmp_path / "deadline.json", "--tests", ",".join(names), "--quiet",
                    "--deadline", "0", timeout=600)
    for name in names:
        outcome = run["tests"][name]
        assert outcome["outcome"] == "timeout" and "killed by the supervisor" in outcome["cause"][0], outcome
