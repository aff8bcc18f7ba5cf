"""The fault-tolerance tests' fixture: ``run_factory(n)`` makes a run of a coordinator and ``n``
replicas in the test's directory (:class:`tests.support.ft_run.Runs`); every process is ended
at the test's end, whatever it did."""

import pytest

from tests.support.ft_run import Runs


@pytest.fixture
def run_factory(tmp_path):
    runs = Runs(tmp_path)
    yield runs
    runs.close()
