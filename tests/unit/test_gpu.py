"""commlib.gpu without a GPU, in one process: import without CuPy, device selection arithmetic,
the preflight decision, the watchdog and ``GpuWork`` with host-side stand-ins for CUDA events,
and ``scripts/gpu_check.py`` reporting "no GPU". Under mpiexec and on a GPU: tests/mpi/test_gpu.py.
"""

import subprocess
import sys
import time

import pytest

from commlib import CommError, CommTimeoutError, InvalidUsageError
from commlib.execution.work import Work
from commlib.gpu.device import LocalGpus, local_ranks, select_device
from commlib.gpu.preflight import GpuSetupError, RankRecord, decide, format_nccl_version
from commlib.gpu.watchdog import Watchdog
from commlib.gpu.work import GpuWork
from tests.support.gpu import HAS_GPU
from tests.support.mpirun import ROOT


def test_import_commlib_without_cupy():
    code = ("import sys; sys.modules['cupy'] = None\n"  # makes `import cupy` raise ImportError
            "import commlib, commlib.gpu\n"
            "from commlib.gpu.device import import_cupy, probe_local_gpus\n"
            "assert import_cupy() is None\n"
            "info = probe_local_gpus(want_nccl=True)\n"
            "assert info.problem == 'cupy is not installed' and info.uuids == [], info\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_local_ranks_and_device_selection():
    assert local_ranks(["a", "b", "a", "a", "b"]) == [0, 0, 1, 2, 1]
    assert [select_device(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert select_device(3, 8, explicit=5) == 5
    with pytest.raises(InvalidUsageError, match="rank 2: a CuPy array on a rank without a GPU"):
        select_device(0, 0, rank=2)
    with pytest.raises(InvalidUsageError, match=r"device=4 out of range.*0 <= device < 2"):
        select_device(0, 2, explicit=4)
    with pytest.raises(InvalidUsageError, match="must be an int"):
        select_device(0, 2, explicit=True)


def record(rank, host, uuids, *, transport="nccl", nccl=22805, explicit=None, problem=""):
    return RankRecord(rank, transport, explicit, LocalGpus(host, list(uuids), nccl, "14.2.0", problem))


def test_decide_assigns_local_rank_modulo_gpus():
    four = [f"GPU-{i}" for i in range(4)]
    records = [record(r, f"node{r // 4}", [f"{u}-{r // 4}" for u in four]) for r in range(8)]
    assert decide(records) == [0, 1, 2, 3, 0, 1, 2, 3]


def test_decide_names_ranks_sharing_a_gpu():
    records = [record(r, "n0", ["GPU-x", "GPU-y"]) for r in range(3)]  # ranks 0 and 2 -> GPU 0
    with pytest.raises(GpuSetupError, match=r"ranks 0, 2 on host n0 would all use GPU 0 \(GPU-x\)"):
        decide(records)
    assert decide([record(r, "n0", ["GPU-x"], transport="host_staged") for r in range(3)]) == [0, 0, 0]


def test_decide_names_nccl_version_mismatch_and_missing_gpus():
    records = [record(0, "a", ["GPU-a"]), record(1, "b", ["GPU-b"], nccl=22703), record(2, "c", ["GPU-c"])]
    with pytest.raises(GpuSetupError, match=r"NCCL 2\.28\.5 on ranks 0, 2; NCCL 2\.27\.3 on rank 1"):
        decide(records)
    records = [record(0, "a", ["GPU-a"]), record(1, "b", [], problem="cupy is not installed")]
    with pytest.raises(GpuSetupError, match=r"rank without a usable GPU.*rank 1 on b: cupy is not installed"):
        decide(records)
    records = [record(0, "a", ["GPU-a"]), record(1, "b", ["GPU-b"], nccl=0, problem="NCCL library not loadable")]
    with pytest.raises(GpuSetupError, match=r"nccl GPU transport cannot run on every rank.*rank 1 on b: NCCL"):
        decide(records)


def test_format_nccl_version():
    assert format_nccl_version(22805) == "2.28.5"
    assert format_nccl_version(2708) == "2.7.8"
    assert format_nccl_version(0) == "none"


class HostEvent:
    """A CUDA event's ``done`` flag, set by a host timer."""

    def __init__(self, after_seconds):
        self._at = time.monotonic() + after_seconds

    @property
    def done(self):
        return time.monotonic() >= self._at


def gpu_work(name, finishes_after, timeout, seq=1):
    work = GpuWork(name, 1024, None, None, time.monotonic() + timeout)
    work.seq = seq
    work.done_event = HostEvent(finishes_after)
    work.keepalive = object()
    return work


def test_gpu_work_synchronize_and_watchdog_completion():
    fired = []
    watchdog = Watchdog("t", lambda expired: fired.append(expired))
    work = gpu_work("allreduce", 0.05, timeout=10)
    calls = []
    work.add_done_callback(calls.append)
    watchdog.track(work)
    assert not work.is_completed()
    assert work.synchronize() is True
    assert work.is_completed() and work.is_success() and work.keepalive is None
    assert calls == [work]
    other = gpu_work("broadcast", 0.02, timeout=10, seq=2)
    watchdog.track(other)
    deadline = time.monotonic() + 5
    while watchdog.in_flight() and time.monotonic() < deadline:  # the watchdog alone completes it
        time.sleep(0.01)
    assert watchdog.in_flight() == 0 and other._done.is_set() and other.is_success() and not fired
    watchdog.close()


def test_watchdog_times_out_fails_every_work_in_flight_once():
    fired = []

    def on_timeout(expired):
        fired.append(expired)
        root = CommTimeoutError(f"{expired.collective} #{expired.seq} ({expired.nbytes} B) timed out")
        return lambda work: root if work is expired else CommTimeoutError(f"{work.collective} #{work.seq} aborted")

    watchdog = Watchdog("t", on_timeout, poll_seconds=1e-3)
    stuck = gpu_work("allreduce", 60, timeout=0.2, seq=7)
    later = gpu_work("reduce", 60, timeout=30, seq=8)
    watchdog.track(stuck)
    watchdog.track(later)
    start = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"allreduce #7 \(1024 B\) timed out"):
        stuck.synchronize()
    assert 0.15 < time.monotonic() - start < 3
    with pytest.raises(CommTimeoutError, match="reduce #8 aborted"):
        later.synchronize()
    assert fired == [stuck] and watchdog.fired and stuck.keepalive is None
    watchdog.close()
    assert watchdog._thread is None


def test_watchdog_fails_a_work_whose_event_query_raises():
    class BrokenEvent:
        @property
        def done(self):
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    watchdog = Watchdog("t", lambda expired: pytest.fail("no timeout expected"))
    work = gpu_work("allgather", 60, timeout=30, seq=4)
    work.done_event = BrokenEvent()
    watchdog.track(work)
    with pytest.raises(CommError, match="allgather #4: polling its done event failed: cudaErrorIllegalAddress"):
        deadline = time.monotonic() + 5
        while not work._done.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        work.synchronize()
    watchdog.close()


def test_gpu_work_reports_an_enqueue_error():
    work = GpuWork("allreduce", 8, None, None, float("inf"))
    inner = Work("allreduce", 5, 8)
    work.attach(inner)
    assert work.seq == 5 and not work.is_completed()
    inner.complete(CommTimeoutError("rank 1: allreduce #5 timed out waiting for recv from rank 0"))
    assert work.is_completed() and not work.is_success()
    with pytest.raises(CommTimeoutError, match="recv from rank 0"):
        work.synchronize()
    with pytest.raises(CommTimeoutError):
        work.wait()


@pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")
def test_gpu_check_script_reports_no_gpu():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("FAIL  env") and "no GPU" in lines[0]
    assert lines[-1] == "0 passed, 1 failed, 6 skipped: no GPU on this machine"
    syntax = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
