"""Faults end in an error on every rank within a bounded time: never a hang, never a wrong result."""

import re
import subprocess
import time

import pytest

from mpirun import MPI_SCRIPTS, run_mpi

TIMEOUT = 2.0  # the group's timeout inside the job
SLACK = 8.0    # process start-up and teardown on a loaded 2-core machine


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
@pytest.mark.parametrize("mode", ["skip", "different", "mismatch", "mismatch_op"])
def test_surviving_faults_raise_on_every_rank(mode, nprocs):
    started = time.monotonic()
    result = run_mpi("faults.py", nprocs, mode, TIMEOUT, timeout=60)
    assert "OK:" in result.stdout
    assert time.monotonic() - started < 40


def _no_process_left(marker: str) -> bool:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True)
    return found.stdout.strip() == ""


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["exception", "exit", "kill"])
def test_a_dying_rank_ends_the_job(mode):
    started = time.monotonic()
    result = run_mpi("faults.py", 3, mode, TIMEOUT, timeout=60, check=False)
    elapsed = time.monotonic() - started
    output = result.stdout
    assert result.returncode != 0, output
    assert "collective #2 returned" not in output, output
    assert elapsed < TIMEOUT + SLACK + 5, f"took {elapsed:.1f} s\n{output}"
    if mode == "exception":
        assert "rank 1/3 failed with an uncaught exception" in output and "injected failure" in output
    elif mode == "exit":
        assert re.search(r"rank 1 \(its process exited", output), output
    else:
        assert "signal 9" in output, output
        killed_pid = re.search(r"PID (\d+)", output).group(1)
        rank_of_pid = dict((pid, rank) for rank, pid in re.findall(r"(\d+):(\d+)@", output))
        assert rank_of_pid.get(killed_pid) == "1", f"pid {killed_pid} not mapped to rank 1\n{output}"
    time.sleep(0.5)
    assert _no_process_left(str(MPI_SCRIPTS / "faults.py")), "ranks left running"


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs", [2, 3])
def test_bad_input_raises_before_sending_and_peers_time_out(nprocs):
    result = run_mpi("bad_inputs.py", nprocs, timeout=90)
    assert "OK:" in result.stdout


@pytest.mark.mpi
def test_soak_memory_threads_and_latency_stay_flat():
    result = run_mpi("load.py", 2, "10000", "200", "64", timeout=240)
    assert "OK:" in result.stdout
