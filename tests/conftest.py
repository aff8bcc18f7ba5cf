import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mpich_leftovers  # found through the path set above

_SEGMENTS_BEFORE = pytest.StashKey[set]()


def pytest_sessionstart(session):
    session.config.stash[_SEGMENTS_BEFORE] = mpich_leftovers.segments()


def pytest_sessionfinish(session, exitstatus):
    # What killed ranks of this session's jobs left in /dev/shm (see tests/mpich_leftovers.py);
    # files that were there before the session are someone else's to judge.
    before = session.config.stash.get(_SEGMENTS_BEFORE, None)
    if before is not None:
        mpich_leftovers.remove_unmapped(mpich_leftovers.segments() - before)
