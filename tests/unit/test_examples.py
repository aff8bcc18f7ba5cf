"""Every example under mpi_examples/ has a test (tests/mpi/test_examples.py runs them under
mpiexec) and starts with the command that runs it."""

from tests.mpi.test_examples import EXAMPLES, TESTED, example


def test_every_example_is_tested_and_starts_with_its_run_line():
    files = {path.name for path in EXAMPLES.glob("*.py")}
    assert files == TESTED, f"examples without a test (or tests without an example): {files ^ TESTED}"
    for name in sorted(files):
        lines = example(name).read_text().splitlines()
        assert lines[0].startswith("# mpiexec -n ") and f"mpi_examples/{name}" in lines[0], name
        # 150: train_digits.py carries the choice of synchronisation (--sync) next to DDP.
        assert 30 <= len(lines) <= 150, f"{name}: {len(lines)} lines; examples stay readable in a minute"
