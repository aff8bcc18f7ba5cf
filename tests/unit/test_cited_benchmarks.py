"""Every benchmark record a code comment cites as its data exists in docs/benchmarks/.

Thresholds in the code keep their reason and point to the data: docs/benchmarks/NAME, and in the
same clause shorthands for its siblings (``NAME-p2 and -p4``, ``NAME-p2, -p4, -symmetric-p2``,
``NAME-p2 (P = 4: -p4)``: the last part of NAME replaced). A citation of a file that was never
checked in sends a reader nowhere.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "docs" / "benchmarks"
SOURCES = sorted(path for package in ("commlib", "ddp", "autograd_bridge") for path in (ROOT / package).rglob("*.py"))

# A name of lower-case words ending in a world shape (p4, 2x2), then the rest of its clause.
CITATION = re.compile(r"docs/benchmarks/([a-z0-9-]+-(?:p\d+|\dx\d))(?![\w.])([^.;]*)")
SHORTHAND = re.compile(r"(?<=[\s(,:])-(?:[a-z]+-)*(?:p\d+|\dx\d)\b")


def cited(text: str):
    """The record names ``text`` cites (comment markers and line breaks folded)."""
    flat = re.sub(r"\n\s*#?\s*", " ", text)
    for match in CITATION.finditer(flat):
        name = match.group(1)
        yield name
        stem = name.rsplit("-", 1)[0]
        for shorthand in SHORTHAND.findall(match.group(2).split("docs/benchmarks/")[0]):
            yield stem + shorthand


def test_the_shorthand_is_read_as_the_code_means_it():
    text = "data: docs/benchmarks/shm-movers-p2, -p4, -symmetric-p2).\n# and docs/benchmarks/hosts-x-2x2 and\n# -2x1."
    assert list(cited(text)) == ["shm-movers-p2", "shm-movers-p4", "shm-movers-symmetric-p2", "hosts-x-2x2",
                                 "hosts-x-2x1"]
    assert list(cited("docs/benchmarks/c-allreduce-p2 and -p4 (P = 3: -p3).")) == ["c-allreduce-p2",
                                                                                   "c-allreduce-p4", "c-allreduce-p3"]
    # A command that would write a record (a placeholder, a .json) is no citation.
    assert list(cited("--json docs/benchmarks/collectives-NAME-p3.json and docs/benchmarks/a-p3.json")) == []


def test_every_cited_record_exists():
    missing = {str(source.relative_to(ROOT)): sorted({name for name in cited(source.read_text())
                                                      if not (BENCHMARKS / f"{name}.json").exists()})
               for source in SOURCES}
    missing = {source: names for source, names in missing.items() if names}
    assert not missing, f"citations of docs/benchmarks/ records that do not exist: {missing}"
