"""Run a script under a real ``mpiexec`` from pytest, with a hard timeout.

A multi-rank test is a script under ``tests/mpi/`` (or an example) that every rank runs; it
exits 0 when the check passed on *every* rank (see :mod:`tests.support.verdict`). The test
process is killed, whole process group included, when it outlives ``timeout``: a hang is a
failure, never a stuck CI. Every rank gets :func:`child_environment`: the repository root on its
path, and output one whole line per write (:mod:`tests.support.line_buffered`), so that lines of
different ranks never join.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence

import pytest

from tests.support.processes import collect_after_kill, kill_tree

ROOT = Path(__file__).resolve().parents[2]
MPI_SCRIPTS = ROOT / "tests" / "mpi"


def world_sizes(*default: int, full: Sequence[int] = ()) -> list:
    """``nprocs`` parameters: ``default`` in every run, ``full`` only under ``pytest -m full`` (or
    ``-m ""``): on a 2-core machine P=4 and P=8 cost most of the suite, and each behaviour they test
    is also checked at P=2 (a power of two) and P=3 (not one) in the default run."""
    return [*default, *(pytest.param(n, marks=pytest.mark.full) for n in full)]


WORLD_SIZES = world_sizes(1, 2, 3, full=(4, 8))
LINE_BUFFERED = ROOT / "tests" / "support" / "line_buffered"


def python_path(*extra: str) -> str:
    """``PYTHONPATH`` for a process the tests start: the line-buffering start-up hook first, the
    repository root, then ``extra`` entries (each ``os.pathsep``-separated), without repeats."""
    entries = [str(LINE_BUFFERED), str(ROOT)]
    for part in extra:
        entries += [entry for entry in (part or "").split(os.pathsep) if entry]
    return os.pathsep.join(dict.fromkeys(entries))


def child_environment(env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """What a process the tests start runs with: ``os.environ``, then ``env`` (a ``PYTHONPATH``
    there is added to, not replacing :func:`python_path`'s entries), one thread per BLAS, and
    unbuffered output that still leaves one whole line per write."""
    environment = dict(os.environ)
    environment.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    environment.update(env or {})
    environment["PYTHONPATH"] = python_path((env or {}).get("PYTHONPATH", ""), os.environ.get("PYTHONPATH", ""))
    return environment


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

    ``script``: a path (relative: under ``tests/mpi/``) or ``"-m module"``. ``mpiexec_args``:
    options for mpiexec itself (e.g. ``-disable-auto-cleanup``)."""
    module = script[3:] if isinstance(script, str) and script.startswith("-m ") else None
    script = Path(module or script)
    if module is None and not script.is_absolute():
        script = MPI_SCRIPTS / script
    environment = child_environment(env)
    python = ["-m", module] if module else [str(script)]
    command = [mpiexec_path(), *mpiexec_args, "-n", str(nprocs), sys.executable, *python, *map(str, args)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=environment, cwd=str(ROOT), start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid, stacks=True)
        output = collect_after_kill(process)
        pytest.fail(f"mpiexec -n {nprocs} {script.name} {' '.join(map(str, args))} hung: killed after "
                    f"{timeout:g} s (each rank's threads are at the end)\n--- output ---\n{output[-12000:]}")
    result = subprocess.CompletedProcess(command, process.returncode, output, "")
    if check and process.returncode != 0:
        pytest.fail(f"mpiexec -n {nprocs} {script.name} {' '.join(map(str, args))} exited with "
                    f"{process.returncode}\n--- output ---\n{output[-8000:]}")
    return result


class Part:
    """One rank script of a :class:`Job` with its arguments; ``sizes``: the world sizes (for a job
    on a cluster: the layouts) it runs at, default every one the job runs at."""

    def __init__(self, script, *args, sizes: Optional[Sequence[Hashable]] = None):
        from tests.support.job import label

        self.script, self.args = str(script), [str(arg) for arg in args]
        self.sizes = None if sizes is None else tuple(sizes)
        self.label = label(self.script, self.args)

    def runs_at(self, where: Hashable) -> bool:
        return self.sizes is None or where in self.sizes


Launch = Callable[[Hashable, List[str], float, Optional[Mapping[str, str]]], subprocess.CompletedProcess]


def launch_mpiexec(nprocs, argv, timeout, env):
    """A :class:`Job`'s default launch: ``python -m tests.support.job argv`` on ``nprocs`` local ranks."""
    return run_mpi("-m tests.support.job", nprocs, *argv, timeout=timeout, env=env, check=False)


#: A directory that every pytest process of the session sees (the controller makes it, xdist's
#: workers inherit it): where a shared :class:`Job`'s results are kept.
SHARED_JOBS_ENV = "COMMLIB_TEST_JOBS"


class Job:
    """Rank scripts that run together in one job (:mod:`tests.support.job`) per world size, each
    with its own pytest verdict.

    ``JOB = Job(Part("ddp_equivalence_ranks.py"), Part("ddp_features_ranks.py", "ARG"), timeout=...)``
    at module level; a test calls ``JOB.check(nprocs, "ddp_features_ranks.py", "ARG")``: the first
    such call at a world size runs the job (the parts that run at that size; ``timeout`` bounds
    it), the others read its result. A script passes when every rank ended it with status 0.
    Scripts share the job's start-up, so they must need the same environment and the same
    ``commlib.init`` arguments. ``launch(where, argv, timeout, env)`` starts the job somewhere
    else than under a local mpiexec with ``where`` ranks (a cluster: tests/support/multihost.py).

    ``shared``: a name that makes the job one per session, not one per test file's process: the
    test files that check its scripts may run in different xdist workers (``--dist loadfile``),
    and the first to need it at a world size runs it while the others wait for its result
    (kept under :data:`SHARED_JOBS_ENV`). That is what lets scripts of several test files share
    one start-up of torch per world size."""

    def __init__(self, *parts: Part, timeout: float, env: Optional[Mapping[str, str]] = None,
                 launch: Launch = launch_mpiexec, shared: Optional[str] = None):
        self.parts = list(parts)
        self.timeout = timeout
        self.env = env
        self.launch = launch
        self.shared = shared
        self._results: Dict[Hashable, subprocess.CompletedProcess] = {}
        self._hung: Dict[Hashable, str] = {}

    def labels(self, where: Hashable) -> List[str]:
        return [part.label for part in self.parts if part.runs_at(where)]

    def run(self, where: Hashable) -> subprocess.CompletedProcess:
        """The job's output at ``where`` (run on the first call; a hang fails that test, and the
        later ones at once)."""
        if where in self._hung:
            pytest.fail(f"the job {' | '.join(self.labels(where))} at {where} hung in {self._hung[where]}")
        if where not in self._results:
            from tests.support.job import SEPARATOR

            argv: List[str] = []
            for part in self.parts:
                if part.runs_at(where):
                    path = Path(part.script) if Path(part.script).is_absolute() else MPI_SCRIPTS / part.script
                    argv += [SEPARATOR, str(path), *part.args]
            test = os.environ.get("PYTEST_CURRENT_TEST", "an earlier test").rsplit(" (", 1)[0]
            self._hung[where] = test
            launch = functools.partial(self.launch, where, argv[1:], self.timeout, self.env)
            self._results[where] = launch() if self._shared_dir() is None else self._run_shared(where, launch, test)
            del self._hung[where]
        return self._results[where]

    def _shared_dir(self) -> Optional[Path]:
        directory = os.environ.get(SHARED_JOBS_ENV)
        return Path(directory) if self.shared and directory else None

    def _run_shared(self, where: Hashable, launch, test: str) -> subprocess.CompletedProcess:
        """The session's one run at ``where``: run here, under an exclusive lock on its file, or
        read what the process that ran it wrote (a hang there fails here at once)."""
        directory = self._shared_dir()
        assert directory is not None
        record = directory / f"{self.shared}-{where}.json"
        with open(directory / f"{self.shared}-{where}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even if this process dies
            if record.exists():
                kept = json.loads(record.read_text())
                if "hung" in kept:
                    pytest.fail(f"the job {' | '.join(self.labels(where))} at {where} hung in {kept['hung']} "
                                f"(another pytest worker)")
                return subprocess.CompletedProcess(kept["args"], kept["returncode"], kept["stdout"], "")
            try:
                result = launch()
            except BaseException:
                record.write_text(json.dumps({"hung": test}))  # or failed to start: either way, no result
                raise
            record.write_text(json.dumps({"args": [str(arg) for arg in result.args],
                                          "returncode": result.returncode, "stdout": result.stdout}))
            return result

    def check(self, where: Hashable, script, *args) -> str:
        """Fail the test unless ``script args`` passed at ``where``; its part of the output (rank
        0's lines in order; another rank's last lines may come after it)."""
        from tests.support.job import MARK, label

        name = label(str(script), [str(arg) for arg in args])
        if name not in self.labels(where):
            raise ValueError(f"{name!r} is not a part of this job at {where}: {self.labels(where)}")
        result = self.run(where)
        output = result.stdout
        begin = f"{MARK} begin {name}\n"
        end = re.compile(rf"^{re.escape(MARK)} end {re.escape(name)}: exit codes \[([-\d, ]*)\]$", re.M)
        what = f"{name} in the job {' | '.join(self.labels(where))} at {where}"
        started = output.find(begin)
        ended = end.search(output, started if started >= 0 else 0)
        if started < 0 or ended is None:
            pytest.fail(f"{what} did not {'run' if started < 0 else 'finish'}: the job exited with "
                        f"{result.returncode}\n--- output ---\n{output[-8000:]}")
        part = output[started + len(begin):ended.start()]
        codes = [int(code) for code in ended.group(1).split(",")]
        if any(codes):
            pytest.fail(f"{what}: exit codes {codes} (rank order)\n--- its output ---\n{part[-8000:]}")
        return part
