"""Several rank scripts in one job (tests/support/job.py) keep a verdict each: a script that
fails fails its own test only, one that raises ends the job and fails its test and every later
script's, and each script sees its own arguments. A shared job runs once per session, whichever
pytest process asks first."""

import pytest

from tests.support.mpirun import SHARED_JOBS_ENV, Job, Part, launch_mpiexec

pytestmark = pytest.mark.mpi

JOB = Job(Part("job_passes_ranks.py", "first"), Part("job_fails_ranks.py"), Part("job_passes_ranks.py", "second"),
          Part("job_raises_ranks.py"), Part("job_passes_ranks.py", "third"), timeout=120)
Failed = pytest.fail.Exception


def test_scripts_before_and_after_a_failing_one_pass_with_their_own_arguments():
    assert "job_passes: argv ['first']" in JOB.check(2, "job_passes_ranks.py", "first")
    assert "job_passes: argv ['second']" in JOB.check(2, "job_passes_ranks.py", "second")


def test_a_failing_script_fails_its_test_with_every_ranks_status():
    with pytest.raises(Failed, match=r"job_fails_ranks.py .* exit codes \[1, 1\](?s:.*)rank 1 fails on purpose"):
        JOB.check(2, "job_fails_ranks.py")


def test_a_script_that_raises_ends_the_job_and_the_later_scripts_did_not_run():
    with pytest.raises(Failed, match=r"job_raises_ranks.py .* did not finish(?s:.*)rank 0 raises on purpose"):
        JOB.check(2, "job_raises_ranks.py")
    with pytest.raises(Failed, match=r"job_passes_ranks.py third .* did not run"):
        JOB.check(2, "job_passes_ranks.py", "third")


def test_a_script_the_job_does_not_hold_is_a_usage_error():
    with pytest.raises(ValueError, match="not a part of this job"):
        JOB.check(2, "job_passes_ranks.py", "fourth")


def test_a_shared_job_runs_once_and_a_second_process_reads_its_result(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_JOBS_ENV, str(tmp_path))
    launches = []

    def counted(*args):
        launches.append(args[0])
        return launch_mpiexec(*args)

    def made():  # as each pytest worker makes it: the same job, its own object
        return Job(Part("job_passes_ranks.py", "shared"), timeout=120, launch=counted, shared="once")

    first = made().check(2, "job_passes_ranks.py", "shared")
    second = made().check(2, "job_passes_ranks.py", "shared")
    assert "job_passes: argv ['shared']" in first and second == first
    assert launches == [2]
    made().check(1, "job_passes_ranks.py", "shared")  # another world size: its own run
    assert launches == [2, 1]


def test_a_shared_job_that_hung_fails_the_other_processes_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv(SHARED_JOBS_ENV, str(tmp_path))
    launches = []

    def hangs(*args):
        launches.append(args[0])
        pytest.fail("hung: killed after 120 s")

    def made():
        return Job(Part("job_passes_ranks.py", "hung"), timeout=120, launch=hangs, shared="hangs")

    with pytest.raises(Failed, match="hung: killed"):
        made().check(2, "job_passes_ranks.py", "hung")
    with pytest.raises(Failed, match=r"hung in .*test_a_shared_job_that_hung.* \(another pytest worker\)"):
        made().check(2, "job_passes_ranks.py", "hung")
    assert launches == [2]
