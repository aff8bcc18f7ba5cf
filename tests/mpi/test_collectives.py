"""Every collective under real mpiexec at world sizes 1, 2, 3, 4 and 8 (8 oversubscribed).

* collectives_ranks.py: the public API with ``native`` and ``auto``, sync and async, the
  small-message fast path, subgroups;
* collectives_allreduce_ranks.py and collectives_algorithms_ranks.py: every algorithm of
  allreduce, and of every other collective, against closed forms, with tiny 16-byte segments so
  the pipelined paths run on short inputs (the two share a job per world size; world sizes 5..7
  run on the in-process transport: tests/unit/test_collective_schedules.py, test_schedules.py).
"""

import pytest

from tests.support.mpirun import WORLD_SIZES, Job, Part, run_mpi

pytestmark = pytest.mark.mpi

EVERY_ALGORITHM = Job(Part("collectives_allreduce_ranks.py", "16"), Part("collectives_algorithms_ranks.py", "16"),
                      timeout=300)


@pytest.mark.parametrize("nprocs", WORLD_SIZES)
def test_collectives_native_and_auto(nprocs):
    run_mpi("collectives_ranks.py", nprocs, "auto", "native", timeout=240)


@pytest.mark.parametrize("nprocs", WORLD_SIZES)
def test_algorithms_under_mpiexec(nprocs):
    EVERY_ALGORITHM.check(nprocs, "collectives_allreduce_ranks.py", "16")


@pytest.mark.parametrize("nprocs", WORLD_SIZES)
def test_collective_algorithms_under_mpiexec(nprocs):
    EVERY_ALGORITHM.check(nprocs, "collectives_algorithms_ranks.py", "16")
