"""Runs tests of torch's distributed suite one after another; one JSON line per event to a file.

    BACKEND=commlib WORLD_SIZE=2 python -m tests.torchsuite.worker --list LIST.json
    BACKEND=commlib WORLD_SIZE=2 python -m tests.torchsuite.worker EVENTS.jsonl NAMES.json

The supervisor (:mod:`tests.torchsuite.run_torch_suite`) starts it, reads the events as they
come (``ready`` with torch's version once imported, or ``unknown`` naming tests the suite does
not have; ``start`` with the test's timeout; ``end`` with its outcome), and kills it (ranks
included) when a test outlives its deadline. Each test is torch's
harness at work: this process is the test's parent, which starts one process per rank and
joins them under the harness's own timeout.
"""

from __future__ import annotations

import json
import sys
import time
import unittest

from tests.torchsuite import outcomes


def list_tests(path: str) -> None:
    from tests.torchsuite.harness import TestDistBackendWithSpawn, common_distributed

    names = unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn)
    listing = [{"test": name, "timeout": common_distributed.get_timeout(name)} for name in names]
    with open(path, "w") as out:
        json.dump(listing, out)


class _Result(unittest.TestResult):
    """Keeps the one outcome of one test."""

    def __init__(self):
        super().__init__()
        self.outcome = outcomes.Outcome("error", "the test reported nothing")

    def addSuccess(self, test):
        self.outcome = outcomes.Outcome("passed")

    def addSkip(self, test, reason):
        self.outcome = outcomes.Outcome("skipped", str(reason))

    def addFailure(self, test, err):
        self.outcome = outcomes.from_exception_text(self._exc_info_to_string(err, test), assertion=True)

    def addError(self, test, err):
        self.outcome = outcomes.from_exception_text(self._exc_info_to_string(err, test), assertion=False)

    def addExpectedFailure(self, test, err):
        self.outcome = outcomes.Outcome("passed", "expected failure")

    def addUnexpectedSuccess(self, test):
        self.outcome = outcomes.Outcome("failed", "unexpected success of a test marked expectedFailure")


def run_tests(events_path: str, names_path: str) -> None:
    import torch

    from tests.torchsuite.harness import TestDistBackendWithSpawn, common_distributed

    with open(names_path) as source:
        names = json.load(source)
    known = set(unittest.TestLoader().getTestCaseNames(TestDistBackendWithSpawn))
    with open(events_path, "a", buffering=1) as events:
        unknown = [name for name in names if name not in known]
        if unknown:
            events.write(json.dumps({"event": "unknown", "tests": unknown}) + "\n")
            return
        events.write(json.dumps({"event": "ready", "torch": torch.__version__}) + "\n")
        for name in names:
            events.write(json.dumps({"event": "start", "test": name,
                                     "timeout": common_distributed.get_timeout(name)}) + "\n")
            started = time.monotonic()
            result = _Result()
            TestDistBackendWithSpawn(name).run(result)
            record = {"event": "end", "test": name, "seconds": round(time.monotonic() - started, 2)}
            record.update(result.outcome.as_dict())
            events.write(json.dumps(record) + "\n")


def main(argv) -> None:
    if argv[:1] == ["--list"] and len(argv) == 2:
        list_tests(argv[1])
    elif len(argv) == 2:
        run_tests(argv[0], argv[1])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
