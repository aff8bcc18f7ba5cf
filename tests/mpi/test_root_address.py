"""Every rank finds the torch backend's store at rank 0's address without DNS, or at
MASTER_ADDR/MASTER_PORT (commlib.rendezvous.root_probe; its parts: tests/unit/test_root_address.py)."""

import pytest

from tests.support.launch import free_port
from tests.support.mpirun import Job, Part


@pytest.mark.mpi
def test_rendezvous_store_on_one_host_and_with_master_addr_and_port():
    pytest.importorskip("torch")
    master = ("127.0.0.1", str(free_port()))  # below the ephemeral range: no outgoing connection takes it
    job = Job(Part("root_address_ranks.py"), Part("root_address_ranks.py", *master), timeout=120)  # one torch start
    job.check(2, "root_address_ranks.py")
    job.check(2, "root_address_ranks.py", *master)
