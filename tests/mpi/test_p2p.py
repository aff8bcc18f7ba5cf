"""Point-to-point (send/recv/isend/irecv, ANY_SOURCE, monitored_barrier) under real mpiexec."""

import pytest

from tests.support.mpirun import run_mpi


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", (2, 3))
def test_point_to_point_under_mpiexec(nprocs):
    result = run_mpi("p2p_ranks.py", nprocs, timeout=120)
    assert "OK:" in result.stdout


@pytest.mark.mpi
def test_a_wait_for_a_peer_that_exited_ends_with_peer_exited_error():
    # The job's timeout is 60 s; a CommTimeoutError (or a hang) would mean the board was not read.
    result = run_mpi("p2p_peer_exit_ranks.py", 3, timeout=45)
    assert "OK: 4 checks on 2 ranks" in result.stdout, result.stdout
    # Whole lines, one per wait: the ranks' output never joins (tests/support/line_buffered).
    lines = [line for line in result.stdout.splitlines() if line.startswith("p2p_peer_exit:")]
    assert len(lines) == 4 and all(": OK after" in line for line in lines), result.stdout
