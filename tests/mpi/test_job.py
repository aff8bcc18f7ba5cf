"""Several rank scripts in one job (tests/support/job.py) keep a verdict each: a script that
fails fails its own test only, one that raises ends the job and fails its test and every later
script's, and each script sees its own arguments."""

import pytest

from tests.support.mpirun import Job, Part

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
