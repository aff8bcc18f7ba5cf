"""Render the generated pages of docs/: benchmarks.md from docs/benchmarks/*.json, configuration.md
from commlib/config.py.

    python scripts/render_docs.py            # write both pages
    python scripts/render_docs.py --check    # exit 1 if either differs from what is checked in

Neither page is edited by hand: change the data (a benchmark's ``--json`` output) or config.py's
table, then run this. ``tests/unit/test_docs.py`` fails when a page and its source disagree.
Standard library only, and nothing is imported from commlib (importing it starts MPI): config.py
is read as text.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_DIR = ROOT / "docs" / "benchmarks"
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"
CONFIG_SOURCE = ROOT / "commlib" / "config.py"
CONFIGURATION_PAGE = ROOT / "docs" / "configuration.md"

SCHEMA = "commlib-bench/1"
REQUIRED = {"schema": str, "benchmark": str, "command": str, "date": str, "machine": dict, "world_size": int,
            "columns": list, "rows": list}
OPTIONAL = {"notes": str}
MACHINE_REQUIRED = ("cpu", "cores", "memory_gib", "python", "numpy", "mpi")  # torch: absent where not imported
SIZE_COLUMNS = ("size", "bytes")

# Sections of benchmarks.md, in reading order, by the prefix of the file name; the rest come last.
GROUPS: Tuple[Tuple[str, str], ...] = (
    ("collectives-", "Every collective on one host"),
    ("shm-", "Shared memory within a host"),
    ("hosts-", "Across hosts"),
    ("launch-", "Launched without MPI"),
    ("costmodel-", "The cost model"),
    ("ddp-", "Our DDP"),
    ("torch-backend-", "torch.distributed on the commlib backend"),
    ("efficient-dp-", "Communication-efficient data parallelism on a slow link"),
    ("accuracy-", "Accuracy of the efficient methods"),
    ("ft-", "Fault-tolerant data parallelism"),
)
OTHER_GROUP = "Other measurements"


# --- benchmarks ------------------------------------------------------------------------------------


def problems(doc: Any) -> List[str]:
    """What a benchmark file lacks or gets wrong against the commlib-bench/1 schema (empty: fine)."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    found = []
    for field, kind in REQUIRED.items():
        if field not in doc:
            found.append(f"missing field {field!r}")
        elif not isinstance(doc[field], kind) or (kind is int and isinstance(doc[field], bool)):
            found.append(f"field {field!r} is not a {kind.__name__}")
    for field, kind in OPTIONAL.items():
        if field in doc and not isinstance(doc[field], kind):
            found.append(f"field {field!r} is not a {kind.__name__}")
    if found:
        return found
    if doc["schema"] != SCHEMA:
        found.append(f"schema {doc['schema']!r}, expected {SCHEMA!r}")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", doc["date"]):
        found.append(f"date {doc['date']!r} is not YYYY-MM-DD")
    found += [f"machine lacks {key!r}" for key in MACHINE_REQUIRED if key not in doc["machine"]]
    if not doc["columns"] or not all(isinstance(column, str) for column in doc["columns"]):
        found.append("columns must be a non-empty list of names")
    for index, row in enumerate(doc["rows"]):
        if not isinstance(row, dict):
            found.append(f"row {index} is not an object")
        elif not set(doc["columns"]) & set(row):
            found.append(f"row {index} has none of the columns")
    if not doc["rows"]:
        found.append("no rows")
    return found


def load_benchmarks(directory: Path = BENCHMARKS_DIR) -> List[Tuple[str, Dict[str, Any]]]:
    """(name, document) for every ``*.json`` of ``directory``, in the page's order."""
    files = [(path.stem, json.loads(path.read_text())) for path in sorted(directory.glob("*.json"))]
    return sorted(files, key=lambda item: (_group_index(item[0]), item[0]))


def _group_index(name: str) -> int:
    for index, (prefix, _) in enumerate(GROUPS):
        if name.startswith(prefix):
            return index
    return len(GROUPS)


def _group_title(name: str) -> str:
    index = _group_index(name)
    return GROUPS[index][1] if index < len(GROUPS) else OTHER_GROUP


def format_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def format_cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) and column in SIZE_COLUMNS:
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 1000 else f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return " ".join(format_cell(column, item) for item in value)
    return str(value).replace("|", "\\|")


def _machine_line(machine: Dict[str, Any]) -> str:
    software = [f"Python {machine['python']}", f"numpy {machine['numpy']}"]
    if machine.get("torch"):
        software.append(f"torch {machine['torch']}")
    software.append(str(machine["mpi"]))
    return f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB; {', '.join(software)}"


def _ranks(doc: Dict[str, Any]) -> str:
    return "1 rank" if doc["world_size"] == 1 else f"{doc['world_size']} ranks"


def _numeric(column: str, rows: Sequence[Dict[str, Any]]) -> bool:
    values = [row.get(column) for row in rows if row.get(column) is not None]
    return bool(values) and all(isinstance(value, (int, float)) and not isinstance(value, bool) for value in values)


def render_table(columns: Sequence[str], rows: Sequence[Dict[str, Any]]) -> List[str]:
    lines = ["| " + " | ".join(columns) + " |",
             "| " + " | ".join("---:" if _numeric(column, rows) else "---" for column in columns) + " |"]
    lines += ["| " + " | ".join(format_cell(column, row.get(column)) for column in columns) + " |" for row in rows]
    return lines


BENCHMARKS_INTRO = """\
# Benchmarks

<!-- Generated by scripts/render_docs.py from docs/benchmarks/*.json. Do not edit: change the data, then run
     `python scripts/render_docs.py`. tests/unit/test_docs.py checks that the two agree. -->

Every figure the docs quote is here. Each one sits with the command that made it, the date and the
machine. Each section is one file of [`benchmarks/`](benchmarks/), in the `commlib-bench/1` format
that every benchmark command writes with `--json`. The other pages link to these sections instead of
repeating numbers.

**Read them as what they are.** They come from one shared VM with 2 cores. Runs at 4 or 8 ranks are
oversubscribed (two or more ranks per core), and "hosts" are network namespaces on that same VM. The
same ratio moves by 10-20% between runs. The tables tell you what the schedules do relative to each
other and to the MPI library on that machine. Measure your own machine before you rely on a
threshold.

How the benchmarks measure, in the manner of nccl-tests:

- The contenders of one size take turns: each iteration calls every one once, and the first one
  rotates. A slow spell of the machine therefore hits them all alike.
- Every call starts from a barrier and a fresh copy of the rank-derived input.
- A row reports the median over iterations of the slowest rank's time.
- `ratio` is the row's time over the MPI library's own blocking call in the same run (below 1 is
  faster). `busbw` is nccl-tests' bus bandwidth. `#wrong` (`wrong`) counts the elements that
  differ from the closed-form result.

```bash
.venv/bin/mpiexec -n 2 .venv/bin/python -m commlib.bench --json out.json          # allreduce, every algorithm
.venv/bin/mpiexec -n 4 .venv/bin/python -m commlib.bench --collective allgather   # or any other collective
.venv/bin/mpiexec -n 2 .venv/bin/python -m commlib.bench -a ring,shm_twoshot,auto --symmetric --floor
.venv/bin/mpiexec -n 4 .venv/bin/python -m commlib.bench --collective barrier -n 500
.venv/bin/mpiexec -n 2 .venv/bin/python -m ddp.bench --model mlp                  # our DDP vs torch's (gloo, commlib)
.venv/bin/mpiexec -n 2 .venv/bin/python -m ddp.bench --sync ddp powersgd localsgd partial local
.venv/bin/mpiexec -n 2 .venv/bin/python -m autograd_bridge.bench                  # dist.all_reduce and torch DDP
```

Benchmarks are scripts that print tables. They are never timed tests: run them on a quiet machine.
To add or refresh a table, drop the `--json` file of a run into `docs/benchmarks/` (its name is the
section's anchor) and run `python scripts/render_docs.py`.
"""


def render_benchmarks(directory: Path = BENCHMARKS_DIR) -> str:
    documents = load_benchmarks(directory)
    lines = [BENCHMARKS_INTRO.rstrip("\n"), "", "## Contents", ""]
    group = None
    for name, doc in documents:
        if _group_title(name) != group:
            group = _group_title(name)
            lines.append(f"- {group}")
        lines.append(f"  - [{name}](#{name}): `{doc['benchmark']}`, {_ranks(doc)}, {doc['date']}")
    group = None
    for name, doc in documents:
        if _group_title(name) != group:
            group = _group_title(name)
            lines += ["", f"## {group}"]
        lines += ["", f"### {name}", "",
                  f"`{doc['benchmark']}`, {_ranks(doc)}, {doc['date']}, on {_machine_line(doc['machine'])}.",
                  "", "```bash", doc["command"], "```", ""]
        if doc.get("notes"):
            lines += [f"Notes: {doc['notes'].rstrip('.')}.", ""]
        lines += render_table(doc["columns"], doc["rows"])
    return "\n".join(lines) + "\n"


# --- configuration ---------------------------------------------------------------------------------


def _rst_to_markdown(text: str) -> str:
    text = re.sub(r":[a-z]+:`~?([^`]+)`", r"`\1`", text)  # :mod:`x`, :class:`~x.Y` -> `x`
    return text.replace("``", "`")


def config_table(source: str) -> List[Tuple[str, str, str]]:
    """(variable, meaning, default) rows of the simple table in config.py's docstring.

    Lenient about alignment: a row starts with a variable name at column 0, its default is the
    last stretch of text after two spaces near the default column, and indented lines continue
    the meaning.
    """
    docstring = ast.get_docstring(ast.parse(source)) or ""
    lines = docstring.splitlines()
    rules = [index for index, line in enumerate(lines) if re.fullmatch(r"=+( +=+)+", line)]
    if len(rules) < 3:
        raise ValueError(f"{CONFIG_SOURCE}: no variable table (three '=====  =====' rules) in the module docstring")
    meaning_end = [match.end() for match in re.finditer("=+", lines[rules[0]])][1]
    rows: List[List[str]] = []
    for line in lines[rules[1] + 1:rules[2]]:
        if not line.strip():
            continue
        if line[0] != " ":
            name = line.split(" ", 1)[0]
            rest = line[len(name):]
            default = ""
            last = re.search(r"\s{2,}(\S+(?: \S+)*)\s*$", line)
            if last and last.start(1) >= meaning_end - 6:
                default = last.group(1)
                rest = line[len(name):last.start()]
            rows.append([name, rest.strip(), default])
        elif rows:
            rows[-1][1] += " " + line.strip()
    return [(_rst_to_markdown(name), _rst_to_markdown(meaning), _rst_to_markdown(default))
            for name, meaning, default in rows]


def config_fields(source: str) -> List[Tuple[str, str, str]]:
    """(field, type, default) of the ``Config`` dataclass, as written in config.py."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == "Config":
            return [(item.target.id, ast.unparse(item.annotation), ast.unparse(item.value) if item.value else "")
                    for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
    raise ValueError(f"{CONFIG_SOURCE}: no class Config")


CONFIGURATION_INTRO = """\
# Configuration

<!-- Generated by scripts/render_docs.py from commlib/config.py (its docstring's table and the Config
     dataclass). Do not edit: change config.py, then run `python scripts/render_docs.py`. -->

commlib reads every environment variable in one place,
[`commlib/config.py`](../commlib/config.py). It reads them into one frozen `commlib.Config`
(`commlib.load_config()`, read from `os.environ` at call time). `commlib.init()` reads it once.
Per-call options are arguments (`algorithm=`, `timeout=` on point-to-point), and the arguments of
`commlib.init(timeout=, debug=, segment_bytes=, gpu_transport=)` win over the environment. An
invalid value (`COMMLIB_TIMEOUT=-1`, `COMMLIB_SHM=maybe`) is a `ValueError` naming the variable.

Launch every rank with the same settings. A rank that picks a different algorithm, timeout or
shared-memory setting than its peers does not compute a different result: it ends in a named
error (see [reliability.md](reliability.md)).

## Environment variables
"""

CONFIGURATION_OUTRO = """\
## Variables commlib does not own

- `MASTER_ADDR`, `MASTER_PORT`: the torch backend's rendezvous
  (`autograd_bridge.init_process_group()`) uses them when set, as torch does. Otherwise rank 0
  sends its interface addresses over MPI ([multi-host.md](multi-host.md#launching-on-several-hosts)).
- MPICH's own (`MPIR_CVAR_*`, `FI_PROVIDER`, `FI_TCP_IFACE`, ...) and torch's (`GLOO_SOCKET_IFNAME`)
  pass through untouched. The cluster tool sets the ones it needs
  ([multi-host.md](multi-host.md#many-hosts-on-one-machine)).
"""


def render_configuration(path: Path = CONFIG_SOURCE) -> str:
    source = path.read_text()
    lines = [CONFIGURATION_INTRO.rstrip("\n"), "", "| variable | meaning | default |", "| --- | --- | --- |"]
    lines += [f"| {name} | {meaning} | {default} |" for name, meaning, default in config_table(source)]
    lines += ["", "## The `Config` object", "",
              ("The attributes of `commlib.Config` as config.py declares them (`Config.from_env(mapping)` "
              "builds one from any mapping, for tests):"), "",
              "| attribute | type | default |", "| --- | --- | --- |"]
    lines += [f"| `{name}` | `{kind}` | `{default}` |" for name, kind, default in config_fields(source)]
    lines += ["", CONFIGURATION_OUTRO.rstrip("\n")]
    return "\n".join(lines) + "\n"


# --- the command line ------------------------------------------------------------------------------


def rendered() -> Dict[Path, str]:
    return {BENCHMARKS_PAGE: render_benchmarks(), CONFIGURATION_PAGE: render_configuration()}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="render docs/benchmarks.md and docs/configuration.md")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when a page is stale")
    args = parser.parse_args(argv)
    bad = [f"{path.relative_to(ROOT)}: {problem}" for path in sorted(BENCHMARKS_DIR.glob("*.json"))
           for problem in problems(json.loads(path.read_text()))]
    if bad:
        print("\n".join(bad), file=sys.stderr)
        return 1
    stale = []
    for path, text in rendered().items():
        if path.exists() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    verb = "stale" if args.check else "written"
    for path in stale:
        print(f"{path.relative_to(ROOT)}: {verb}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
