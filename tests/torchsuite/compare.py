"""Compare runs of torch's distributed suite test by test: the table, and every test that passes
on the reference backend but not on the other, with its cause and, where it is a known
exception, why.

    python -m tests.torchsuite.compare /tmp/commlib-torchsuite/gloo-p2.json /tmp/commlib-torchsuite/commlib-p2.json

The exit status is 1 when a test that passes on the reference fails on the other and is not an
exception listed in :data:`EXCEPTIONS`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Tuple

from tests.torchsuite.outcomes import KINDS

# Tests that pass on gloo and cannot pass on another backend: they test gloo itself (its
# messages, its API gates in torch's Python). Name -> why.
EXCEPTIONS: Dict[str, str] = {
    "test_barrier_timeout_full_group": (
        "asserts gloo's wording of a timeout (regex ' (Timed out|closed|timeout) '); commlib raises "
        "CommTimeoutError 'rank 0: barrier #2, ... timed out after 1 s waiting for recv of 0 B from rank 1' "
        "on time (the wording is commlib's, below the bridge)"),
    "test_monitored_barrier_gloo": (
        "torch's dist.monitored_barrier refuses every backend but gloo ('monitored_barrier is only implemented "
        "for GLOO backend', in torch's Python); the commlib group's own monitored_barrier is tested in tests/"),
    "test_monitored_barrier_gloo_subgroup": "as test_monitored_barrier_gloo: torch's gate for gloo",
    "test_monitored_barrier_failure_order": "as test_monitored_barrier_gloo: torch's gate for gloo (P=8)",
    "test_monitored_barrier_wait_all_ranks": "as test_monitored_barrier_gloo: torch's gate for gloo (P=8)",
    "test_barrier_timeout_group": "as test_barrier_timeout_full_group: gloo's wording of a timeout (P=8)",
    "test_monitored_barrier_gloo_rank_0_timeout": (
        "calls the group's monitored_barrier with timedelta(0) and asserts gloo's wording 'Rank 0 timed out in "
        "monitoredBarrier'; commlib refuses a zero timeout before anything is sent (InvalidUsageError: timeout "
        "must be a positive finite number of seconds), and names missing ranks in its own words"),
}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def counts(run: dict) -> Dict[str, int]:
    found = dict.fromkeys(KINDS, 0)
    for outcome in run["tests"].values():
        found[outcome["outcome"]] += 1
    return found


def regressions(reference: dict, other: dict) -> List[Tuple[str, str, str, str]]:
    """(test, its outcome on ``other``, its first cause, the exception's reason or "") for each test
    that passed on ``reference`` and did not pass (or did not run) on ``other``."""
    found = []
    for name, outcome in sorted(reference["tests"].items()):
        if outcome["outcome"] != "passed":
            continue
        theirs = other["tests"].get(name, {"outcome": "not run"})
        if theirs["outcome"] == "passed":
            continue
        cause = (theirs.get("cause") or [theirs.get("reason", "")])[0]
        found.append((name, theirs["outcome"], cause, EXCEPTIONS.get(name, "")))
    return found


def table(runs: List[dict]) -> str:
    header = "| backend | world size | " + " | ".join(KINDS) + " | tests | seconds | torch |"
    rule = "|" + "---|" * (len(KINDS) + 5)
    rows = [header, rule]
    for run in runs:
        found = counts(run)
        rows.append(f"| {run['backend']} | {run['world_size']} | " + " | ".join(str(found[k]) for k in KINDS)
                    + f" | {len(run['tests'])} | {run.get('seconds', 0):g} | {run.get('torch')} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reference", type=Path, help="the reference run's JSON (gloo)")
    parser.add_argument("other", type=Path, help="the compared run's JSON (commlib)")
    args = parser.parse_args(argv)
    reference, other = load(args.reference), load(args.other)
    print(table([reference, other]))
    found = regressions(reference, other)
    unexplained = [entry for entry in found if not entry[3]]
    print(f"\npassed on {reference['backend']}, not on {other['backend']}: {len(found)} "
          f"({len(found) - len(unexplained)} listed exceptions)")
    for name, outcome, cause, reason in found:
        print(f"  {name}: {outcome}: {cause[:200]}" + (f"\n      exception: {reason}" if reason else ""))
    return 1 if unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
