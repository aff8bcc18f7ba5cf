"""How many checks the rank scripts of a test session ran, summed over jobs and ranks.

A pytest item that launches ``mpiexec`` counts as one test however many checks its ranks make;
the number that says how much a job covers is :attr:`Checker.checks <tests.support.verdict.Checker>`.
Rank 0 of every job that ends in :meth:`Checker.finish` appends one line to the file named by
``COMMLIB_TEST_CHECK_LOG`` (when set; ``tests/conftest.py`` sets it for a session and prints the
total at the end). One ``write`` per line in append mode, so concurrent jobs never mix lines.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

ENV = "COMMLIB_TEST_CHECK_LOG"


class JobChecks(NamedTuple):
    """One job's verdict: what ran, on how many ranks, its checks over all ranks, its failures."""

    test: str
    script: str
    ranks: int
    checks: int
    failures: int


def record(ranks: int, checks: int, failures: int) -> None:
    """Append this job's line to the session's log (nothing when no log is named)."""
    path = os.environ.get(ENV)
    if not path:
        return
    entry = JobChecks(test=os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0],
                      script=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                      ranks=ranks, checks=checks, failures=failures)
    line = (json.dumps(entry._asdict()) + "\n").encode()
    descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)


def read(path: Optional[str] = None) -> List[JobChecks]:
    """The jobs logged so far (the session's log unless ``path`` is given)."""
    path = path or os.environ.get(ENV)
    if not path or not os.path.exists(path):
        return []
    with open(path) as log:
        return [JobChecks(**json.loads(line)) for line in log if line.strip()]


def per_test_file(jobs: List[JobChecks]) -> Dict[str, int]:
    """Checks per test file (the part of the pytest node id before ``::``)."""
    totals: Dict[str, int] = {}
    for job in jobs:
        name = job.test.split("::", 1)[0] or "(outside pytest)"
        totals[name] = totals.get(name, 0) + job.checks
    return totals
