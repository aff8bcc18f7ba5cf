"""Every example under mpi_examples/ has a test (tests/mpi/test_examples.py runs them under
mpiexec; the ones launched without MPI, one process per host, run on namespaced hosts in
tests/multihost/) and starts with the command that runs it."""

from tests.mpi.test_examples import EXAMPLES, TESTED, example

# name -> the test that runs it
WITHOUT_MPI = {"train_digits_ft.py": "tests/multihost/test_ft_hosts.py"}


def test_every_example_is_tested_and_starts_with_its_run_line():
    files, tested = {path.name for path in EXAMPLES.glob("*.py")}, TESTED | set(WITHOUT_MPI)
    assert files == tested, f"examples without a test (or tests without an example): {files ^ tested}"
    for name in sorted(files):
        lines = example(name).read_text().splitlines()
        launcher = "# python " if name in WITHOUT_MPI else "# mpiexec -n "
        assert lines[0].startswith(launcher) and f"mpi_examples/{name}" in lines[0], name
        if name in WITHOUT_MPI:
            test = EXAMPLES.parent / WITHOUT_MPI[name]
            assert f'"{name}"' in test.read_text(), f"{name}: {WITHOUT_MPI[name]} does not run it"
        # 150: train_digits.py carries the choice of synchronisation (--sync) next to DDP.
        assert 30 <= len(lines) <= 150, f"{name}: {len(lines)} lines; examples stay readable in a minute"
