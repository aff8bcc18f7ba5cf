"""One test's outcome in torch's distributed suite, and what its failure said.

Kinds: ``passed``, ``skipped`` (with the harness's reason), ``failed`` (an assertion failed, in
the test's parent or in a rank), ``error`` (any other exception, a rank that died), ``timeout``
(the harness's per-test timeout, or the supervisor's deadline behind it). A failure keeps its
``cause``: the exception line of every rank that raised (torch's harness gathers the ranks'
tracebacks into one RuntimeError), and ``detail``: the first lines of the message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List

KINDS = ("passed", "failed", "error", "timeout", "skipped")
NOT_PASSING = ("failed", "error", "timeout")
DETAIL_LINES = 25
DETAIL_CHARS = 2500

# (The first block starts on the parent's exception line: "RuntimeError: Process 0 exited ...".)
_RANK_BLOCK = re.compile(r"^(?:[\w.]+: )?Process (\d+) exited with error code \d+ and exception:$", re.M)
_HARNESS_TIMEOUT = re.compile(r"Process \d+ terminated or timed out after [\d.]+ seconds")


@dataclass
class Outcome:
    kind: str
    reason: str = ""
    cause: List[str] = field(default_factory=list)
    detail: str = ""

    def as_dict(self) -> dict:
        record: dict = {"outcome": self.kind}
        if self.reason:
            record["reason"] = self.reason
        if self.cause:
            record["cause"] = self.cause
        if self.detail:
            record["detail"] = self.detail
        return record


def exception_line(traceback_text: str) -> str:
    """The ``Type: message`` line of a formatted traceback (the first line after its last frame)."""
    lines = traceback_text.splitlines()
    last_frame = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1)
    for line in lines[last_frame + 1:]:
        if line.strip() and not line.startswith(" "):
            return line.strip()
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


def from_exception_text(text: str, assertion: bool) -> Outcome:
    """The outcome of a test whose parent raised, given the formatted exception."""
    blocks = _RANK_BLOCK.split(text)
    if len(blocks) > 1:  # [parent's part, rank, traceback, rank, traceback, ...]
        causes = [f"rank {rank}: {exception_line(tb)}" for rank, tb in zip(blocks[1::2], blocks[2::2])]
        kind = "failed" if all("AssertionError" in c.split(": ", 2)[1] for c in causes) else "error"
        body = blocks[2]
    else:
        line = exception_line(text)
        causes = [line]
        if _HARNESS_TIMEOUT.search(text):
            kind = "timeout"
        else:
            kind = "failed" if assertion or line.startswith("AssertionError") else "error"
        body = text
    return Outcome(kind, cause=_unique(causes), detail=_first_lines(body))


def _first_lines(text: str) -> str:
    """The message without the traceback's frames: what a reader wants first."""
    lines = text.splitlines()
    last_frame = max((i for i, line in enumerate(lines) if line.startswith("  File ")), default=-1)
    kept = [line for line in lines[last_frame + 1:] if line.strip()]
    kept = [line for line in kept if not line.startswith("    ")] or kept
    return "\n".join(kept[:DETAIL_LINES])[:DETAIL_CHARS]


def _unique(items: List[str]) -> List[str]:
    return list(dict.fromkeys(items))
