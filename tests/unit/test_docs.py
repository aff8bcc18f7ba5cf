"""The README and docs/ stay true: generated pages match their sources, measurements follow the
schema, relative links resolve, and the README stays a README.

The generated pages are docs/benchmarks.md (from docs/benchmarks/*.json) and docs/configuration.md
(from commlib/config.py), both written by ``python scripts/render_docs.py``.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
PACKAGES = ("commlib", "autograd_bridge", "ddp")


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "scripts" / "render_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_docs = _load_renderer()
RERENDER = "run `python scripts/render_docs.py` and commit the result"


# --- generated pages -------------------------------------------------------------------------------


def test_benchmarks_page_is_what_the_data_renders():
    assert render_docs.BENCHMARKS_PAGE.read_text() == render_docs.render_benchmarks(), \
        f"docs/benchmarks.md differs from docs/benchmarks/*.json: {RERENDER}"


def test_configuration_page_is_what_config_py_renders():
    assert render_docs.CONFIGURATION_PAGE.read_text() == render_docs.render_configuration(), \
        f"docs/configuration.md differs from commlib/config.py: {RERENDER}"


def _benchmark_files() -> List[Path]:
    return sorted((DOCS / "benchmarks").glob("*.json"))


def test_there_are_measurements():
    assert len(_benchmark_files()) >= 10


@pytest.mark.parametrize("path", _benchmark_files(), ids=lambda path: path.name)
def test_benchmark_file_follows_the_schema(path):
    found = render_docs.problems(json.loads(path.read_text()))
    assert not found, f"{path.relative_to(ROOT)} (schema {render_docs.SCHEMA}): " + "; ".join(found)


def test_the_schema_check_names_every_missing_field():
    valid = json.loads(_benchmark_files()[0].read_text())
    assert render_docs.problems(valid) == []
    for field in render_docs.REQUIRED:
        broken = copy.deepcopy(valid)
        del broken[field]
        assert f"missing field {field!r}" in render_docs.problems(broken)
    for key in render_docs.MACHINE_REQUIRED:
        broken = copy.deepcopy(valid)
        del broken["machine"][key]
        assert f"machine lacks {key!r}" in render_docs.problems(broken)
    broken = dict(valid, date="1 December 2026", schema="commlib-bench/0", world_size="2")
    assert render_docs.problems(broken) == ["field 'world_size' is not a int"]
    broken["world_size"] = 2
    assert render_docs.problems(broken) == ["schema 'commlib-bench/0', expected 'commlib-bench/1'",
                                            "date '1 December 2026' is not YYYY-MM-DD"]


def test_the_renderer_shows_every_column_of_every_file_in_order(tmp_path):
    doc = {"schema": "commlib-bench/1", "benchmark": "commlib.bench", "command": "mpiexec -n 2 python -m commlib.bench",
           "date": "2026-12-01", "machine": {"cpu": "x", "cores": 2, "memory_gib": 24, "python": "3.11", "numpy": "2",
                                             "mpi": "MPICH"},
           "world_size": 2, "columns": ["size", "algorithm", "time_us", "ok"],
           "rows": [{"size": 1 << 20, "algorithm": "ring", "time_us": 12345.678, "ok": True, "hidden": 1},
                    {"size": 8, "algorithm": "a|b", "time_us": 0.5}]}
    (tmp_path / "zz-made-up.json").write_text(json.dumps(doc))
    page = render_docs.render_benchmarks(tmp_path)
    assert "## Other measurements" in page and "### zz-made-up" in page
    assert "| size | algorithm | time_us | ok |\n| ---: | --- | ---: | --- |" in page
    assert "| 1 MiB | ring | 12345.7 | yes |" in page
    assert "| 8 B | a\\|b | 0.5 | - |" in page
    assert "torch" not in page.split("### zz-made-up")[1]  # an absent torch is not invented


def test_configuration_documents_every_variable_config_py_reads():
    source = render_docs.CONFIG_SOURCE.read_text()
    documented = {name.strip("`") for name, _, _ in render_docs.config_table(source)}
    tree = ast.parse(source)
    docstring = tree.body[0].value if isinstance(tree.body[0], ast.Expr) else None  # the table itself
    read: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node is not docstring:
            read.update(re.findall(r"COMMLIB_[A-Z_]*[A-Z]", node.value))
        elif isinstance(node, ast.JoinedStr):  # f"COMMLIB_ALGO_{collective.upper()}"
            head = node.values[0]
            if isinstance(head, ast.Constant) and str(head.value).startswith("COMMLIB_"):
                read.add(str(head.value) + "<NAME>")
    assert read, "found no COMMLIB_ variable in config.py's code"
    assert read == documented, (f"config.py reads {sorted(read - documented)} without documenting them, "
                                f"documents {sorted(documented - read)} it does not read")


def test_only_config_py_reads_commlib_variables():
    # One module reads the environment (DESIGN.md, Configuration): a read elsewhere escapes the docs.
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == render_docs.CONFIG_SOURCE:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "COMMLIB_" in line and re.search(r"environ\b|getenv\(", line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "COMMLIB_ variables read outside commlib/config.py:\n" + "\n".join(found)


# --- links -----------------------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda match: match.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _without_code_blocks(markdown: str) -> str:
    """Fenced blocks blanked out, line for line (so line numbers stay right)."""
    return re.sub(r"^```.*?^```", lambda match: "\n" * match.group(0).count("\n"), markdown,
                  flags=re.MULTILINE | re.DOTALL)


def _without_code(markdown: str) -> str:
    return re.sub(r"`[^`\n]*`", "", _without_code_blocks(markdown))


def anchors(markdown: str) -> Set[str]:
    seen: Dict[str, int] = {}
    found = set()
    for line in _without_code_blocks(markdown).splitlines():
        match = re.match(r"#{1,6} (.*)", line)
        if not match:
            continue
        slug = github_slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path) -> List[str]:
    """Relative links of ``page`` whose file, or heading anchor in a Markdown file, is missing."""
    found = []
    text = page.read_text()
    for number, line in enumerate(_without_code(text).splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path_part, _, anchor = target.partition("#")
            destination = (page.parent / path_part).resolve() if path_part else page
            if not destination.exists():
                found.append(f"{page.name}:{number}: {target}: no such file")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination.read_text()):
                found.append(f"{page.name}:{number}: {target}: no heading with anchor #{anchor}")
    return found


def _pages() -> List[Path]:
    return [README] + sorted(DOCS.glob("*.md"))


@pytest.mark.parametrize("page", _pages(), ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    found = broken_links(page)
    assert not found, "broken links:\n" + "\n".join(found)


def test_the_link_check_catches_missing_files_and_anchors(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Launching `mpiexec`, step 2\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n[ok](other.md#launching-mpiexec-step-2) [self](#page) [web](https://example.com)\n"
                    "[gone](missing.md) [no anchor](other.md#nowhere) [bad self](#elsewhere)\n"
                    "`[in code](missing.md)`\n```\n[in a block](missing.md)\n```\n")
    assert broken_links(page) == ["page.md:3: missing.md: no such file",
                                  "page.md:3: other.md#nowhere: no heading with anchor #nowhere",
                                  "page.md:3: #elsewhere: no heading with anchor #elsewhere"]


def test_every_docs_page_is_linked_from_the_readme():
    text = README.read_text()
    missing = [page.name for page in sorted(DOCS.glob("*.md")) if f"docs/{page.name}" not in text]
    assert not missing, f"README.md links to no {missing}"


# --- the README and the drawings -------------------------------------------------------------------


def test_readme_is_at_most_250_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move depth to docs/"


def _readme_algorithm_table() -> Dict[str, Set[str]]:
    """{collective: names} from the README's table headed ``| collective | algorithms |``."""
    lines = README.read_text().splitlines()
    start = lines.index("| collective | algorithms |") + 2
    table: Dict[str, Set[str]] = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        collective, names = (cell.strip() for cell in line.strip("|").split("|"))
        table[collective] = set(re.findall(r"`([a-z_]+)`", names))
    return table


def test_readme_algorithm_table_lists_every_registered_algorithm():
    from commlib.algorithms.registry import COLLECTIVES, algorithm_names

    table = _readme_algorithm_table()
    for collective in COLLECTIVES:
        assert collective in table, f"README's algorithm table has no row for {collective}"
        registered = set(algorithm_names(collective)) - {"native"}
        assert table[collective] == registered, (f"README lists {sorted(table[collective])} for {collective}, "
                                                 f"the registry has {sorted(registered)}")


def _sections(markdown: str, level: str = "## ") -> List[Tuple[str, str]]:
    """(heading, body) of each section at ``level``."""
    sections: List[Tuple[str, str]] = []
    for line in _without_code_blocks(markdown).splitlines():
        if line.startswith(level):
            sections.append((line[len(level):], ""))
        elif sections:
            sections[-1] = (sections[-1][0], sections[-1][1] + line + "\n")
    return sections


def test_algorithms_page_has_a_section_per_registered_algorithm():
    from commlib.algorithms.registry import COLLECTIVES, algorithm_names

    sections = _sections((DOCS / "algorithms.md").read_text())
    missing = []
    for collective in COLLECTIVES:
        bodies = [body for heading, body in sections if collective in re.findall(r"[a-z_]+", heading)]
        described = {name for body in bodies for line in body.splitlines() if line.startswith("### ")
                     for name in re.findall(r"`([a-z_]+)`", line)}
        missing += [f"{collective}: {name}" for name in algorithm_names(collective)
                    if name != "native" and name not in described]
    assert not missing, f"docs/algorithms.md has no ### heading under its collective's ## section for {missing}"


def _tree_folders() -> List[Tuple[int, str]]:
    text = (DOCS / "architecture.md").read_text()
    block = text.split("## The tree", 1)[1].split("```", 2)[1]
    folders = []
    for line in block.splitlines():
        match = re.match(r"( *)(\S+)/(\s|$)", line)
        if match:
            folders.append((len(match.group(1)) // 2, match.group(2)))
    return folders


def test_the_tree_in_architecture_md_shows_every_package_folder():
    shown: Set[str] = set()
    stack: List[str] = []
    for depth, name in _tree_folders():
        stack[depth:] = [name]
        shown.add("/".join(stack))
    on_disk = {str(path.parent.relative_to(ROOT)) for package in PACKAGES
               for path in (ROOT / package).rglob("__init__.py") if "__pycache__" not in path.parts}
    assert not on_disk - shown, f"docs/architecture.md's tree lacks {sorted(on_disk - shown)}"
    stale = {folder for folder in shown if folder.split("/")[0] in PACKAGES} - on_disk
    assert not stale, f"docs/architecture.md's tree shows folders that do not exist: {sorted(stale)}"
