"""torchrun across two hosts of network namespaces (c10d rendezvous): sockets between the hosts,
shared memory inside each, the hierarchical allreduce across them; no MPI anywhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import LAUNCH_SCRIPTS, ROOT, base_env
from tests.support.multihost import make_cluster, processes_on_hosts

pytestmark = [pytest.mark.multihost, pytest.mark.launch]


@pytest.fixture(scope="module")
def cluster():
    with make_cluster(2) as made:
        yield made


def test_torchrun_on_two_hosts_runs_every_collective_exactly(cluster):
    endpoint = f"{cluster.addresses[0]}:29755"
    processes = []
    for node, host in enumerate(cluster.hostnames):
        argv = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2",
                "--nproc-per-node", "2", "--node-rank", str(node), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", f"{cluster.name}-collectives",
                str(LAUNCH_SCRIPTS / "launch_ranks.py"), "collectives"]
        processes.append(cluster.popen(host, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=base_env(), cwd=str(ROOT), start_new_session=True))
    outputs = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=400)
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            pytest.fail("torchrun on two hosts hung (killed after 400 s)")
        outputs.append((process.returncode, output))
    everything = "\n".join(output for _, output in outputs)
    assert all(code == 0 for code, _ in outputs), everything[-8000:]
    counts = re.findall(r"rank (\d+): (\d+) checks OK", everything)
    assert sorted(int(rank) for rank, _ in counts) == [0, 1, 2, 3], everything[-4000:]
    assert processes_on_hosts(cluster) == {}, "processes left behind on the hosts"
