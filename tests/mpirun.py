"""Run a script under a real ``mpiexec`` from pytest, with a hard timeout.

A multi-rank test is a script under ``tests/mpi/`` (or an example) that every rank runs; it
exits 0 when the check passed on *every* rank (see :mod:`tests.mpi.verdict`). The test process
is killed, whole process group included, when it outlives ``timeout``: a hang is a failure,
never a stuck CI.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPI_SCRIPTS = Path(__file__).resolve().parent / "mpi"
WORLD_SIZES = (1, 2, 3, 4, 8)


def mpiexec_path() -> str:
    candidate = Path(sys.executable).parent / "mpiexec"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mpiexec")
    if found is None:
        pytest.skip("no mpiexec found (pip install mpich, or install a system MPI)")
    return found


def run_mpi(script, nprocs: int, *args: str, timeout: float = 120.0, env=None,
            check: bool = True, mpiexec_args=()) -> subprocess.CompletedProcess:
    """Run ``python script args`` on ``nprocs`` ranks; fail the test on timeout or (if check) non-zero exit.

    ``mpiexec_args``: options for mpiexec itself (e.g. ``-disable-auto-cleanup``)."""
    script = Path(script)
    if not script.is_absolute():
        script = MPI_SCRIPTS / script
    environment = dict(os.environ)
    environment.update({
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH", "")])),
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    })
    environment.update(env or {})
    command = [mpiexec_path(), *mpiexec_args, "-n", str(nprocs), sys.executable, str(script), *map(str, args)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment, cwd=str(ROOT), start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"mpiexec -n {nprocs} {script.name} {' '.join(map(str, args))} hung: killed after "
                    f"{timeout:g} s\n--- output ---\n{output[-6000:]}")
    result = subprocess.CompletedProcess(command, process.returncode, output, "")
    if check and process.returncode != 0:
        pytest.fail(f"mpiexec -n {nprocs} {script.name} {' '.join(map(str, args))} exited with "
                    f"{process.returncode}\n--- output ---\n{output[-8000:]}")
    return result
