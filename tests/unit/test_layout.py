"""The tests' own layout, so that a newcomer finds what runs where (and it stays that way).

* ``tests/unit/``: one process; nothing here starts mpiexec.
* ``tests/mpi/`` and ``tests/multihost/``: pytest files that launch jobs, and beside them the
  rank scripts they run, named ``<topic>[_<part>]_ranks.py`` after the ``test_<topic>.py`` that
  runs them; each script's docstring starts with the command that runs it from the repository
  root (``PYTHONPATH=.``: the scripts import ``tests.support``).
* ``tests/support/``: what the tests share (a package, imported as ``tests.support.*``).
"""

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
JOB_FOLDERS = (TESTS / "mpi", TESTS / "multihost")
# Run by test_bench.py, whose owner names it: the one script not (yet) in the scheme.
NOT_IN_THE_SCHEME = {"bench_broken_barrier.py"}


def rank_scripts():
    return sorted(path for folder in JOB_FOLDERS for path in folder.glob("*.py")
                  if not path.name.startswith("test_") and path.name != "__init__.py"
                  and path.name not in NOT_IN_THE_SCHEME)


def test_rank_scripts_are_named_after_the_test_file_that_runs_them():
    assert rank_scripts(), "no rank scripts found"
    for script in rank_scripts():
        assert script.name.endswith("_ranks.py"), f"{script.relative_to(TESTS)}: rank scripts end in _ranks.py"
        words = script.name[:-len("_ranks.py")].split("_")
        topics = ["_".join(words[:n]) for n in range(1, len(words) + 1)]
        runners = [script.parent / f"test_{topic}.py" for topic in topics]
        runners = [runner for runner in runners if runner.exists()]
        assert runners, f"{script.relative_to(TESTS)}: no test_<topic>.py beside it for any of {topics}"
        assert any(script.name in runner.read_text() for runner in runners), \
            f"{script.relative_to(TESTS)}: {[r.name for r in runners]} never runs it"


def test_every_rank_script_starts_with_the_command_that_runs_it():
    for script in rank_scripts():
        first = ast.get_docstring(ast.parse(script.read_text()), clean=False).splitlines()[0]
        assert first.startswith("PYTHONPATH=."), f"{script.name}: first line {first!r}"
        assert str(script.relative_to(TESTS.parent)) in first, f"{script.name}: first line {first!r}"


def test_one_process_tests_start_no_mpi_job():
    for path in (TESTS / "unit").glob("test_*.py"):
        text = path.read_text()
        assert not re.search(r"\brun_mpi\(|\bmpiexec_path\(|\bJob\(|run_on_cluster\(", text), \
            f"{path.name} starts an MPI job: it belongs in tests/mpi/"


def test_every_test_file_under_mpi_launches_jobs():
    for path in (TESTS / "mpi").glob("test_*.py"):
        # A job's check: JOB.check(nprocs, "script.py", ...) or JOB.check(nprocs, *script_and_args(...)).
        assert re.search(r"\brun_mpi\(|\bmpiexec_path\(|\.check\(\w+, (\"|\*\w+\()", path.read_text()), \
            f"{path.name} starts no MPI job: one-process tests belong in tests/unit/"
