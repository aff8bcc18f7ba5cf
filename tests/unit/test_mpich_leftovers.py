"""The suite's sweep of MPICH's leftover /dev/shm segments (tests/mpich_leftovers.py), on real
files in /dev/shm: an unmapped leftover goes, a mapped one (a job still running) stays."""

import mmap
import os
import uuid

import pytest

from tests.support import mpich_leftovers


@pytest.fixture
def fake_segment():
    made = []

    def make():
        path = mpich_leftovers.SHM / f"{mpich_leftovers.PREFIX}sweeptest_{uuid.uuid4().hex}"
        path.write_bytes(b"\0" * mmap.PAGESIZE)
        made.append(path)
        return path

    yield make
    for path in made:
        path.unlink(missing_ok=True)


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_sweep_removes_unmapped_leftovers_and_keeps_mapped_ones(fake_segment):
    left, in_use = fake_segment(), fake_segment()
    assert {left.name, in_use.name} <= mpich_leftovers.segments()
    with open(in_use, "r+b") as handle, mmap.mmap(handle.fileno(), mmap.PAGESIZE):
        assert in_use.name in mpich_leftovers.mapped_segments()
        assert left.name not in mpich_leftovers.mapped_segments()
        assert mpich_leftovers.remove_unmapped([left.name, in_use.name, "mpich_shm_gone"]) == 1
        assert not left.exists() and in_use.exists()
