"""The socket transport across 2 hosts made of network namespaces (met through MPI there): each
rank listens on its host's own addresses, connects across, and the collectives stay exact."""

import pytest

from tests.support.multihost import make_cluster, processes_on_hosts, run_on_cluster

pytestmark = [pytest.mark.mpi, pytest.mark.multihost]


@pytest.fixture(scope="module")
def cluster():
    with make_cluster(hosts=2) as made:
        yield made


@pytest.mark.parametrize("nprocs,ppn", [(2, 1), (4, 2)], ids=["2x1", "2x2"])
def test_socket_transport_across_hosts(cluster, nprocs, ppn):
    result = run_on_cluster(cluster, "sockets_over_mpi_ranks.py", nprocs, ppn, timeout=240)
    assert "OK:" in result.stdout
    assert processes_on_hosts(cluster) == {}
