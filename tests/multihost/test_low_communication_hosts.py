"""DiLoCo, Streaming DiLoCo and DES-LOC across 2 hosts of network namespaces (2 ranks each, TCP
between them): every exactness check of tests/mpi/low_communication_ranks.py, with the methods'
allreduces forced to the hierarchical schedule, which ``auto`` picks there for large models."""

import pytest

from tests.support.multihost import make_cluster, run_on_cluster

pytestmark = [pytest.mark.mpi, pytest.mark.multihost]


def test_low_communication_methods_across_hosts_with_the_hierarchical_allreduce():
    with make_cluster(hosts=2) as cluster:
        result = run_on_cluster(cluster, "low_communication_ranks.py", 4, 2, "hierarchical", timeout=400)
    assert "OK:" in result.stdout and "on 4 ranks" in result.stdout, result.stdout[-3000:]
