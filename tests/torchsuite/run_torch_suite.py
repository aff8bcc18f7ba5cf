"""Run torch's distributed test suite for one backend and world size; per-test outcomes as JSON.

    python -m tests.torchsuite.run_torch_suite --backend commlib --world-size 2
    python -m tests.torchsuite.run_torch_suite --backend gloo --world-size 3 -k all_reduce -k barrier
    python -m tests.torchsuite.run_torch_suite --backend commlib --world-size 2 --rerun failed
    python -m tests.torchsuite.compare gloo-p2.json commlib-p2.json      # the table, test by test

The suite is ``DistributedTest`` of ``torch.testing._internal.distributed.distributed_test``
under torch's ``TestDistBackend`` harness (see :mod:`tests.torchsuite.harness`). Tests run one
after another in a worker process (:mod:`tests.torchsuite.worker`); each test's ranks run under
the harness's own timeout (``--test-timeout``, torch's ``DISTRIBUTED_TESTS_DEFAULT_TIMEOUT``), and
behind it this supervisor's deadline (that timeout plus ``--grace``): a test that outlives it is
recorded as ``timeout`` and the worker is killed with its ranks, then restarted at the next test.
The JSON (default ``$TMPDIR/commlib-torchsuite/<backend>-p<size>.json``) is rewritten after
every test, so a run that stops resumes where it was: tests already recorded are not run again
(``--rerun failed`` runs the failed, errored and timed-out ones again; ``--rerun all`` all).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from tests.torchsuite.outcomes import KINDS, NOT_PASSING

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TEST_TIMEOUT = 300  # torch's default per-test timeout (DISTRIBUTED_TESTS_DEFAULT_TIMEOUT)
DEFAULT_GRACE = 120  # the harness needs a moment past its timeout to collect the ranks' tracebacks
STARTUP_SECONDS = 600  # a worker's imports, before its first test starts (slow on a loaded machine)
POLL_SECONDS = 0.1


def default_output(backend: str, world_size: int) -> Path:
    return Path(tempfile.gettempdir()) / "commlib-torchsuite" / f"{backend}-p{world_size}.json"


class Run:
    """The JSON of one run: metadata and every recorded test's outcome, saved after each test."""

    def __init__(self, path: Path, backend: str, world_size: int, start: str):
        self.path = path
        self.data: dict = {"backend": backend, "world_size": world_size, "start": start, "torch": None,
                           "seconds": 0.0, "tests": {}}
        if path.exists():
            previous = json.loads(path.read_text())
            if (previous.get("backend"), previous.get("world_size")) != (backend, world_size):
                raise SystemExit(f"{path} holds a run of {previous.get('backend')} at world size "
                                 f"{previous.get('world_size')}, not {backend} at {world_size}: pass another --out")
            self.data.update(previous)
            self.data["start"] = start

    @property
    def tests(self) -> Dict[str, dict]:
        return self.data["tests"]

    def record(self, name: str, outcome: dict) -> None:
        self.tests[name] = outcome
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_suffix(".json.tmp")
        scratch.write_text(json.dumps(self.data, indent=1, sort_keys=True) + "\n")
        os.replace(scratch, self.path)

    def counts(self) -> Dict[str, int]:
        found = dict.fromkeys(KINDS, 0)
        for outcome in self.tests.values():
            found[outcome["outcome"]] += 1
        return found


def worker_environment(backend: str, world_size: int, start: str, test_timeout: int) -> dict:
    environment = dict(os.environ)
    environment.update({
        "BACKEND": backend,
        "WORLD_SIZE": str(world_size),
        "TORCHSUITE_START": start,
        "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(test_timeout),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH", "")])),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",  # the repro line names torch's file, not ours
    })
    return environment


def list_tests(environment: dict, scratch: Path) -> List[dict]:
    listing = scratch / "tests.json"
    command = [sys.executable, "-m", "tests.torchsuite.worker", "--list", str(listing)]
    subprocess.run(command, env=environment, cwd=str(ROOT), check=True, timeout=STARTUP_SECONDS,
                   stdout=subprocess.DEVNULL)
    return json.loads(listing.read_text())


def select(listing: List[dict], keywords: List[str], names: List[str]) -> List[str]:
    """The suite's tests named in ``names`` (all when empty) whose name contains one of ``keywords``."""
    known = {entry["test"] for entry in listing}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise SystemExit(f"no such tests in torch's suite: {', '.join(unknown)}")
    return [entry["test"] for entry in listing
            if (not names or entry["test"] in names) and (not keywords or any(k in entry["test"] for k in keywords))]


def _kill(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run_pending(run: Run, queue: List[str], environment: dict, scratch: Path, grace: float,
                log_path: Path, say, deadline_override: Optional[float] = None) -> None:
    """Run the tests named in ``queue`` in workers, restarting one past a test that hung or killed it.
    A test's deadline is its harness timeout plus ``grace``, or ``deadline_override``."""
    queue = list(queue)
    while queue:
        names_file, events_file = scratch / "names.json", scratch / "events.jsonl"
        names_file.write_text(json.dumps(queue))
        events_file.write_text("")
        with open(log_path, "a") as log:
            worker = subprocess.Popen([sys.executable, "-m", "tests.torchsuite.worker", str(events_file),
                                       str(names_file)], env=environment, cwd=str(ROOT), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        current: Optional[str] = None
        deadline = 0.0
        since = time.monotonic()
        offset = 0
        try:
            while True:
                exited = worker.poll() is not None  # before reading: what it wrote before exiting is read
                with open(events_file) as events:
                    events.seek(offset)
                    text = events.read()
                complete = text[:text.rfind("\n") + 1]
                offset += len(complete)
                for line in complete.splitlines():
                    event = json.loads(line)
                    kind = event.pop("event")
                    if kind == "unknown":
                        raise SystemExit(f"no such tests in torch's suite: {', '.join(event['tests'])}")
                    if kind == "ready":
                        run.data["torch"] = event["torch"]
                    elif kind == "start":
                        current, since = event["test"], time.monotonic()
                        deadline = event["timeout"] + grace if deadline_override is None else deadline_override
                    else:
                        name = event.pop("test")
                        run.record(name, event)
                        queue.remove(name)
                        current, since = None, time.monotonic()
                        say(name, event)
                if not queue:
                    break
                waited = time.monotonic() - since
                if current is None:  # between tests, or still importing
                    if exited or waited > STARTUP_SECONDS:
                        raise SystemExit(f"the worker {'exited with ' + str(worker.returncode) if exited else 'hung'}"
                                         f" before it started {queue[0]}: see {log_path}")
                elif exited or waited > deadline:
                    if not exited:
                        _kill(worker)
                    stuck = current
                    seconds = round(time.monotonic() - since, 2)
                    if exited:
                        outcome = {"outcome": "error", "seconds": seconds,
                                   "cause": [f"the worker exited with {worker.returncode} during the test"]}
                    else:
                        outcome = {"outcome": "timeout", "seconds": seconds,
                                   "cause": [f"killed by the supervisor after {deadline:g} s (ranks included)"]}
                    run.record(stuck, outcome)
                    queue.remove(stuck)
                    say(stuck, outcome)
                    break
                time.sleep(POLL_SECONDS)
        finally:
            if worker.poll() is None:
                _kill(worker)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=("gloo", "commlib"), required=True)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", type=Path, help="the JSON of outcomes (default: %(default)s)")
    parser.add_argument("-k", dest="keywords", action="append", default=[],
                        help="run the tests whose name contains this (repeatable)")
    parser.add_argument("--tests", default="", help="comma-separated test names to run")
    parser.add_argument("--rerun", choices=("none", "failed", "all"), default="none")
    parser.add_argument("--limit", type=int, default=0, help="run at most this many tests (0: all)")
    parser.add_argument("--test-timeout", type=int, default=DEFAULT_TEST_TIMEOUT)
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE,
                        help="seconds past the harness's timeout before the runner kills a test (default: %(default)s)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after a test started when the runner kills it, instead of timeout + grace")
    parser.add_argument("--start", choices=("fork", "forkserver", "spawn"), default="fork",
                        help="how rank processes start (see tests/torchsuite/harness.py)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    if args.world_size < 2:
        parser.error("torch's suite needs a world size of at least 2")
    out = args.out or default_output(args.backend, args.world_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.backend, args.world_size, args.start)
    environment = worker_environment(args.backend, args.world_size, args.start, args.test_timeout)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="torchsuite-") as scratch_name:
        scratch = Path(scratch_name)
        names = [name for name in args.tests.split(",") if name]
        if args.keywords or not names:  # (named tests alone need no listing: the worker checks them)
            names = select(list_tests(environment, scratch), args.keywords, names)
        if args.rerun == "none":
            names = [name for name in names if name not in run.tests]
        elif args.rerun == "failed":
            names = [name for name in names if run.tests.get(name, {"outcome": "error"})["outcome"] in NOT_PASSING]
        if args.limit:
            names = names[:args.limit]
        total = len(names)
        done = [0]

        def say(name, outcome):
            done[0] += 1
            if not args.quiet:
                cause = outcome.get("cause") or [outcome.get("reason", "")]
                print(f"[{done[0]}/{total}] {outcome['outcome']:8} {outcome.get('seconds', 0):7.1f} s  {name}"
                      + (f"  -- {cause[0][:160]}" if outcome["outcome"] != "passed" and cause[0] else ""),
                      flush=True)

        run_pending(run, names, environment, scratch, args.grace, out.with_suffix(".log"), say, args.deadline)
    run.data["seconds"] = round(run.data.get("seconds", 0.0) + time.monotonic() - began, 1)
    run.save()
    counts = run.counts()
    print(f"{args.backend} p={args.world_size}: " + ", ".join(f"{counts[k]} {k}" for k in KINDS)
          + f" ({len(run.tests)} recorded) -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
