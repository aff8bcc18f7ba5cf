"""tests/torchsuite/outcomes.py: what a failure of torch's suite says, read from the texts torch's
harness raises (its parent gathers each failed rank's traceback into one RuntimeError)."""

from tests.torchsuite import outcomes
from tests.torchsuite.compare import regressions, table

RANK_TRACEBACK = """Traceback (most recent call last):
  File "common_distributed.py", line 1058, in run_test
    getattr(self, test_name)()
  File "distributed_test.py", line 2627, in call_dist_op
    self.assertEqual(len(events), len(op_calls))
{line}
"""


def harness_error(*rank_lines):
    """The parent's exception, as torch's _check_return_codes formats it."""
    body = "".join(f"Process {rank} exited with error code 10 and exception:\n{RANK_TRACEBACK.format(line=line)}\n"
                   for rank, line in rank_lines)
    return f"Traceback (most recent call last):\n  File \"x.py\", line 1, in wrapper\n    fn()\nRuntimeError: {body}"


def test_assertions_on_every_rank_are_a_failure_with_each_rank_s_line():
    text = harness_error((0, "AssertionError: Scalars are not equal!"), (1, "AssertionError: Scalars are not equal!"))
    outcome = outcomes.from_exception_text(text, assertion=False)
    assert outcome.kind == "failed"
    assert outcome.cause == ["rank 0: AssertionError: Scalars are not equal!",
                             "rank 1: AssertionError: Scalars are not equal!"]
    assert outcome.detail.startswith("AssertionError: Scalars are not equal!")
    assert "File " not in outcome.detail


def test_any_other_exception_on_a_rank_is_an_error():
    text = harness_error((0, "AssertionError: x"), (1, "AttributeError: 'NoneType' object has no attribute 'irecv'"))
    outcome = outcomes.from_exception_text(text, assertion=True)
    assert outcome.kind == "error"
    assert "rank 1: AttributeError: 'NoneType' object has no attribute 'irecv'" in outcome.cause


def test_the_harness_s_timeout_is_a_timeout():
    text = ("Traceback (most recent call last):\n  File \"c.py\", line 9, in wrapper\n    self._join_processes(fn)\n"
            "RuntimeError: Process 1 terminated or timed out after 300.1 seconds\n")
    outcome = outcomes.from_exception_text(text, assertion=False)
    assert outcome.kind == "timeout"
    assert outcome.cause == ["RuntimeError: Process 1 terminated or timed out after 300.1 seconds"]


def test_a_failure_in_the_test_s_parent():
    text = "Traceback (most recent call last):\n  File \"t.py\", line 3, in test\n    x()\nAssertionError: 1 != 2\n"
    assert outcomes.from_exception_text(text, assertion=True).kind == "failed"
    text = "Traceback (most recent call last):\n  File \"t.py\", line 3, in test\n    x()\nKeyError: 'WORLD_SIZE'\n"
    assert outcomes.from_exception_text(text, assertion=False).as_dict() == {
        "outcome": "error", "cause": ["KeyError: 'WORLD_SIZE'"], "detail": "KeyError: 'WORLD_SIZE'"}


def run(backend, **tests):
    return {"backend": backend, "world_size": 2, "torch": "2.13.0+cpu", "seconds": 1.0,
            "tests": {name: {"outcome": kind} for name, kind in tests.items()}}


def test_compare_lists_what_passes_on_the_reference_only_with_the_listed_exceptions():
    gloo = run("gloo", test_a="passed", test_b="passed", test_barrier_timeout_full_group="passed", test_c="skipped")
    commlib = run("commlib", test_a="passed", test_b="error", test_barrier_timeout_full_group="failed",
                  test_c="skipped")
    found = regressions(gloo, commlib)
    assert [(name, kind) for name, kind, _, _ in found] == [("test_b", "error"),
                                                            ("test_barrier_timeout_full_group", "failed")]
    assert found[0][3] == "" and "gloo's wording" in found[1][3]
    rows = table([gloo, commlib]).splitlines()
    assert rows[2].startswith("| gloo | 2 | 3 | 0 | 0 | 0 | 1 | 4 |")
    assert rows[3].startswith("| commlib | 2 | 1 | 1 | 1 | 0 | 1 | 4 |")
