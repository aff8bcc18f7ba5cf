"""MPICH's shared-memory segments that killed ranks leave behind, and their removal.

MPICH's shared-memory transport keeps a ``/dev/shm/mpich_shm_*`` file per job (2-3 MB) and
unlinks it once every local rank has mapped it; a rank killed or aborted before that (the fault
tests do it on purpose) leaves the file behind, and tmpfs keeps it in memory. One run of the
suite left 20-25 (about 60 MB); a day of runs on this machine left 2,071 (5.8 GB). The suite
removes, at its end, the ones it created that no process maps any more (its own jobs have all
ended by then; a file still mapped belongs to a job that is still running, and is kept).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Set

SHM = Path("/dev/shm")
PREFIX = "mpich_shm_"


def segments() -> Set[str]:
    """The names of MPICH's segment files in ``/dev/shm`` now."""
    try:
        return {entry.name for entry in os.scandir(SHM) if entry.name.startswith(PREFIX)}
    except OSError:  # no /dev/shm here: nothing to sweep
        return set()


def mapped_segments() -> Set[str]:
    """The names of those files some live process has mapped (from ``/proc/*/maps``)."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended meanwhile, or is not ours to read
            continue
        for line in text.splitlines():
            at = line.find(f"{SHM}/{PREFIX}")
            if at >= 0:
                names.add(line[at + len(str(SHM)) + 1:].split()[0])
    return names


def remove_unmapped(candidates: Iterable[str]) -> int:
    """Remove the ``candidates`` that still exist and no process maps; how many were removed."""
    in_use = mapped_segments()
    removed = 0
    for name in candidates:
        if name in in_use:
            continue
        try:
            (SHM / name).unlink()
            removed += 1
        except FileNotFoundError:
            pass
    return removed
