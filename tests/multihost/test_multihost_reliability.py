"""Faults across hosts: 2 namespace hosts x 2 ranks, the faulty rank (2) on the second host.

The single-host versions are in test_reliability.py; here the point is that a rank on the
*other* host is named with its host ("never heard from rank 2 on host ...-h1 (last started
allreduce #1)"), which the timed-out ranks learn from that host's crash witness over TCP
(commlib/reliability/remote_progress.py), and that every job ends within a bounded time leaving nothing
running on any host.
"""

import re
import time

import pytest

from tests.support.multihost import make_cluster, processes_on_hosts, run_on_cluster

pytestmark = [pytest.mark.mpi, pytest.mark.multihost]

TIMEOUT = 2.0   # the group's timeout inside the job
SLACK = 10.0    # process start-up and teardown of 4 ranks on 2 loaded cores, plus the witness query
FAULTY = 2      # on host h1; ranks 0 and 1 (and mpiexec) are on h0


@pytest.fixture(scope="module")
def cluster():
    with make_cluster(hosts=2) as made:
        yield made


def run_fault(cluster, mode, check):
    started = time.monotonic()
    result = run_on_cluster(cluster, "reliability_faults_ranks.py", 4, 2, mode, TIMEOUT, FAULTY, timeout=90,
                            check=check)
    elapsed = time.monotonic() - started
    assert elapsed < TIMEOUT + SLACK + 5, f"took {elapsed:.1f} s\n{result.stdout}"
    time.sleep(0.5)
    assert processes_on_hosts(cluster) == {}, f"left running after {mode}:\n{result.stdout}"
    return result.stdout


@pytest.mark.parametrize("mode", ["skip", "different", "mismatch"])
def test_surviving_faults_name_the_rank_and_its_host_on_every_rank(cluster, mode):
    # reliability_faults_ranks.py checks on every rank that the error names "rank 2 on host <h1>" (skip, different:
    # learned from h1's witness by the ranks on h0; mismatch: from the debug fingerprints).
    output = run_fault(cluster, mode, check=True)
    assert "OK:" in output, output
    if mode == "skip":
        h1 = cluster.hostnames[1]
        for rank in (0, 1, 3):
            assert re.search(rf"rank {rank}: surfaced in [\d.]+ s: .*never heard from rank 2 on host "
                             rf"{h1} \(last started allreduce #1\)", output), output


def test_a_rank_exiting_on_the_other_host_is_named_with_its_host(cluster):
    output = run_fault(cluster, "exit", check=False)
    h1 = cluster.hostnames[1]
    # Rank 3 (host h1, beside rank 2) sees the exit on its board at once (PeerExitedError); if
    # it is slow to, rank 0 or 1 (host h0) times out first. Either names rank 2 and its host.
    assert re.search(rf"commlib: rank [013]/4 on \S+ failed .*allreduce #2, .*(cannot complete: rank 2 "
                     rf"exited|timed out after 2 s).*never heard from rank 2 on host {h1} \(its process "
                     rf"exited after #1\)", output), output


def test_an_exception_on_the_other_host_ends_the_job_with_its_cause(cluster):
    output = run_fault(cluster, "exception", check=False)
    assert re.search(rf"commlib: rank 2/4 on {cluster.hostnames[1]} failed with an uncaught exception in "
                     r"the main thread: ValueError: injected failure on rank 2; aborting the MPI job", output), output


def test_a_rank_killed_on_the_other_host_is_named_by_that_hosts_witness(cluster):
    output = run_fault(cluster, "kill", check=False)
    h1 = cluster.hostnames[1]
    pid_of_rank = dict(re.findall(r"(\d+):(\d+)@", output))
    named = re.findall(r"crash witness: rank (\d+) \(pid (\d+) on (\S+)\) ended without a clean exit", output)
    assert (("2", pid_of_rank["2"], h1) in named), output
    # Any other line names a rank of the other host (a cleanup kill there), never another on h1.
    assert all(host != h1 for rank, _, host in named if rank != "2"), output
