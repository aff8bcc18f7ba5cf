"""Ending a launched job for good: every process below the launcher killed, and its output
collected with a bound, so a hung test fails instead of stalling the session."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Dict, List

__all__ = ["kill_tree", "stop_tree", "collect_after_kill"]


def _descendants(pid: int) -> List[int]:
    """Every live process below ``pid`` (read from /proc): torchrun starts its workers in sessions
    of their own, so killing a launcher's process group alone can leave them holding our pipe."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        below = children.get(frontier.pop(), [])
        found.extend(below)
        frontier.extend(below)
    return found


def kill_tree(pid: int, stacks: bool = False) -> None:
    """SIGKILL ``pid``, its process group and every process below it. With ``stacks``, first ask
    every Python process below it where its threads are (SIGUSR1: see
    tests/support/line_buffered/sitecustomize.py) and give them a moment to write it."""
    if stacks:
        pythons = [child for child in _descendants(pid) if _is_python(child)]
        for child in pythons:
            try:
                os.kill(child, signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
        if pythons:
            time.sleep(1.0)
    for victim in [pid, *_descendants(pid)]:
        for kill in (os.killpg, os.kill):
            try:
                kill(victim, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def stop_tree(pid: int) -> None:
    """SIGSTOP ``pid`` and every process below it (a hung job: alive, its sockets open, silent)."""
    for victim in [pid, *_descendants(pid)]:
        try:
            os.kill(victim, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            pass


def _is_python(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().startswith("python")
    except OSError:
        return False


def collect_after_kill(process: subprocess.Popen) -> str:
    """What a killed process (tree) printed; bounded even if something still holds the pipe."""
    try:
        output, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        output = "(output lost: the pipe stayed open after the kill)"
    return output or ""
