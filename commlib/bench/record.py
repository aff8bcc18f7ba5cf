"""``--json``: one file format for every benchmark of the project (``commlib-bench/1``).

::

    {"schema": "commlib-bench/1",
     "benchmark": "commlib.bench",                 # which table: commlib.bench, ddp.bench, ...
     "command": "mpiexec -n 2 python -m commlib.bench -b 8 -e 1M --json out.json",
     "date": "2026-12-02",                         # UTC
     "machine": {"cpu": "...", "cores": 2, "memory_gib": 23.5, "python": "3.12.3",
                 "numpy": "2.3.1", "torch": "2.13.0", "mpi": "MPICH Version: 5.0.2"},
     "world_size": 2,
     "notes": "",
     "columns": ["size", "count", ...],            # the table's columns, as its header prints them
     "rows": [{"size": 8, "count": 2, ...}, ...]}

Every row has a value for every column (null where the table prints ``-`` or ``n/a``, and for
a ratio with nothing to divide by) and may carry more keys: context the table does not print
(``commlib.bench``: the collective, the segment size, which ranks share a host). ``torch`` is in
``machine`` only where the benchmark ran with torch. The command is the one that made the
file, with the launcher in front (``python -m MODULE`` for the program), so the docs can quote it
and a reader can run it again.

``write_record`` is for any benchmark script; ``read_record`` checks a file before use.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
import time
from typing import Any, Dict, Mapping, Optional, Sequence

__all__ = ["SCHEMA", "machine_facts", "command_line", "bench_record", "write_record", "read_record"]

SCHEMA = "commlib-bench/1"
KEYS = ("schema", "benchmark", "command", "date", "machine", "world_size", "notes", "columns", "rows")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)
    except (ValueError, OSError, AttributeError):
        return 0.0


def _mpi_library() -> Optional[str]:
    """The first line of ``MPI_Get_library_version`` (e.g. ``MPICH Version: 5.0.2``), spaces folded."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def machine_facts() -> Dict[str, Any]:
    """The machine and software a benchmark ran on (see the module for the keys)."""
    import numpy

    facts: Dict[str, Any] = {"cpu": _cpu_model(), "cores": os.cpu_count() or 1, "memory_gib": _memory_gib(),
                             "python": platform.python_version(), "numpy": numpy.__version__}
    torch = sys.modules.get("torch")  # never imported here: commlib knows no torch
    if torch is not None:
        facts["torch"] = str(torch.__version__)
    mpi = _mpi_library()
    if mpi is not None:
        facts["mpi"] = mpi
    return facts


def command_line(module: str, argv: Sequence[str], world_size: int,
                 environ: Optional[Mapping[str, str]] = None) -> str:
    """The launch as a shell line (arguments quoted where needed): ``mpiexec -n P python -m MODULE
    ARGS``, or under torch's launcher variables without MPI's ``torchrun [--nnodes N]
    --nproc-per-node L -m MODULE ARGS`` (``L``: ``LOCAL_WORLD_SIZE``)."""
    from commlib.platform.launcher import detect_launcher

    environ = os.environ if environ is None else environ
    if detect_launcher(environ) == "env":
        local = int(environ.get("LOCAL_WORLD_SIZE") or world_size)
        nodes = ["--nnodes", str(world_size // local)] if world_size != local and world_size % local == 0 else []
        return shlex.join(["torchrun", *nodes, "--nproc-per-node", str(local), "-m", *module.split(),
                           *map(str, argv)])
    return shlex.join(["mpiexec", "-n", str(world_size), "python", "-m", *module.split(), *map(str, argv)])


def _plain(value: Any) -> Any:
    """JSON's values: no NaN or infinity (null), tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    return value


def bench_record(benchmark: str, *, argv: Sequence[str], world_size: int, columns: Sequence[str],
                 rows: Sequence[Mapping[str, Any]], module: Optional[str] = None, notes: str = "") -> Dict[str, Any]:
    """The record of one run. ``argv``: the benchmark's arguments (``sys.argv[1:]``); ``module``:
    what ``python -m`` runs (default: ``benchmark``). Raises ValueError for a row without a column."""
    for index, row in enumerate(rows):
        missing = [name for name in columns if name not in row]
        if missing:
            raise ValueError(f"{benchmark}: row {index} has no value for column(s) {missing}")
    return {"schema": SCHEMA, "benchmark": benchmark,
            "command": command_line(module or benchmark, argv, world_size),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine_facts(),
            "world_size": world_size, "notes": notes, "columns": list(columns),
            "rows": [_plain(dict(row)) for row in rows]}


def write_record(path, record: Mapping[str, Any]) -> None:
    """Write ``record`` (from :func:`bench_record`) as JSON, a key or a row per line (files checked
    in under ``docs/benchmarks/`` then differ by the rows that changed)."""
    lines = [f" {json.dumps(key)}: {json.dumps(value, allow_nan=False)}," for key, value in record.items()
             if key != "rows"]
    rows = ",\n".join(f"  {json.dumps(row, allow_nan=False)}" for row in record["rows"])
    with open(path, "w") as handle:
        handle.write("{\n" + "\n".join(lines) + '\n "rows": [\n' + rows + ("\n" if rows else "") + " ]\n}\n")


def read_record(path) -> Dict[str, Any]:
    """A ``commlib-bench/1`` file, checked: ValueError naming the file and what is wrong."""
    try:
        with open(path) as handle:
            record = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a benchmark record ({error})") from None
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        found = record.get("schema") if isinstance(record, dict) else type(record).__name__
        raise ValueError(f"{path}: schema {found!r}, expected {SCHEMA!r} (written by a --json of this version)")
    missing = [key for key in KEYS if key not in record]
    if missing:
        raise ValueError(f"{path}: no {', '.join(missing)}")
    for index, row in enumerate(record["rows"]):
        absent = [name for name in record["columns"] if name not in row]
        if absent:
            raise ValueError(f"{path}: row {index} has no value for column(s) {absent}")
    return record
