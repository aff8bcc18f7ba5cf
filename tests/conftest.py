import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.support import check_log, mpich_leftovers
from tests.support.mpirun import SHARED_JOBS_ENV, python_path

_SEGMENTS_BEFORE = pytest.StashKey[set]()
_OWN_CHECK_LOG = pytest.StashKey[str]()
_OWN_JOBS_DIR = pytest.StashKey[str]()


def pytest_configure(config):
    # Every process the session starts (run_mpi's ranks, and the tests' own subprocess.run of
    # mpiexec, python -m ..., examples) writes one whole line per write: see
    # tests/support/line_buffered/sitecustomize.py.
    os.environ["PYTHONPATH"] = python_path(os.environ.get("PYTHONPATH", ""))
    # The rank scripts' checks of this session (tests/support/check_log.py). A log named by the
    # caller is kept (and appended to); otherwise the session makes its own and removes it.
    # Worker processes of pytest-xdist inherit the controller's.
    if not os.environ.get(check_log.ENV):
        descriptor, path = tempfile.mkstemp(prefix="commlib-checks-", suffix=".jsonl")
        os.close(descriptor)
        os.environ[check_log.ENV] = path
        config.stash[_OWN_CHECK_LOG] = path
    # Where the jobs shared by several test files keep their results (tests.support.mpirun.Job).
    if not os.environ.get(SHARED_JOBS_ENV):
        os.environ[SHARED_JOBS_ENV] = tempfile.mkdtemp(prefix="commlib-jobs-")
        config.stash[_OWN_JOBS_DIR] = os.environ[SHARED_JOBS_ENV]


def pytest_unconfigure(config):
    path = config.stash.get(_OWN_CHECK_LOG, None)
    if path is not None:
        os.environ.pop(check_log.ENV, None)
        if os.path.exists(path):
            os.unlink(path)
    directory = config.stash.get(_OWN_JOBS_DIR, None)
    if directory is not None:
        os.environ.pop(SHARED_JOBS_ENV, None)
        shutil.rmtree(directory, ignore_errors=True)


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    jobs = check_log.read()
    if jobs:
        terminalreporter.write_line(
            f"rank-script checks: {sum(job.checks for job in jobs)} (Checker.checks over all ranks) "
            f"in {len(jobs)} jobs")


# The kinds of test, longest files first. Under ``-n 3 --dist loadfile`` this decides less than
# it seems: xdist hands out files by their number of tests, most first (its default
# ``--loadscope-reorder``), and this order only among files with as many tests. Files strictly
# in this order (``--no-loadscope-reorder``) were not faster here: 430 s against 419 s for the
# run just before with the default. The long multi-host and fault-tolerance files mostly sleep
# on timeouts and heartbeats; started together, they leave the two cores idle.
_LONG_FIRST = ("multihost", "ft", "launch", "mpi", "torchsuite", "sockets", "unit")


def pytest_collection_modifyitems(session, config, items):
    def kind(item) -> int:
        parts = Path(str(item.fspath)).parts
        folder = parts[parts.index("tests") + 1] if "tests" in parts else ""
        return _LONG_FIRST.index(folder) if folder in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=kind)  # stable: the order inside a kind stays pytest's


def pytest_sessionstart(session):
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller sweeps, once all have ended
        return
    session.config.stash[_SEGMENTS_BEFORE] = mpich_leftovers.segments()


def pytest_sessionfinish(session, exitstatus):
    # What killed ranks of this session's jobs left in /dev/shm (see tests/support/mpich_leftovers.py);
    # files that were there before the session are someone else's to judge.
    before = session.config.stash.get(_SEGMENTS_BEFORE, None)
    if before is not None:
        mpich_leftovers.remove_unmapped(mpich_leftovers.segments() - before)
