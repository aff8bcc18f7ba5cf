"""Launching ranks without MPI, from pytest: torchrun, or a launcher of our own (one process per rank
with torch's variables), each with a hard timeout so a hang is a failure, never a stuck run."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, NamedTuple, Optional, Sequence

import pytest

from tests.support.processes import collect_after_kill, kill_tree

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_SCRIPTS = ROOT / "tests" / "launch"

__all__ = ["free_port", "run_ranks", "run_torchrun", "RankResult", "base_env", "ROOT", "LAUNCH_SCRIPTS"]


class RankResult(NamedTuple):
    rank: int
    returncode: int
    output: str


def free_port() -> int:
    """A TCP port nobody listens on right now, below the kernel's ephemeral range.

    The OS's pick (port 0) comes from the ephemeral range, and so do the source ports of every
    outgoing connection: between our pick and the launcher's bind, another test's connection
    could take it (torchrun then failed with EADDRINUSE). Below the range, only a listener can."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chooser = random.SystemRandom()
    for _ in range(200):
        port = chooser.randrange(max(1024, low - 12000), low)
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low} after 200 tries")


def base_env(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment of a rank: the repository on the path, no MPI launcher's variables."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PMI_", "PMIX_", "OMPI_", "HYDI_", "MPI_LOCAL"))}
    env.update({"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
                "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    env.update(extra or {})
    return env


def dump_env(timeout: float) -> Dict[str, str]:
    """Ask the rank scripts (tests/launch/launch_ranks.py) to print every thread's stack shortly
    before the test's own timeout, so a hang shows where it hung."""
    return {"COMMLIB_TEST_DUMP_AFTER": f"{max(5.0, timeout - 15):g}"}


def _script(script) -> Path:
    path = Path(script)
    return path if path.is_absolute() else LAUNCH_SCRIPTS / path


def run_ranks(script, world_size: int, *args: str, env: Optional[Mapping[str, str]] = None,
              per_rank_env: Optional[Mapping[int, Mapping[str, str]]] = None, ranks: Optional[Sequence[int]] = None,
              timeout: float = 120.0, master_port: Optional[int] = None) -> List[RankResult]:
    """Start ``python script args`` once per rank (``ranks``: default all of ``world_size``) with
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and
    ``MASTER_PORT`` set as torchrun sets them (``per_rank_env`` overrides them rank by rank), and
    return each one's exit status and output. Every process still running after ``timeout`` is
    killed and the test fails, with what they printed."""
    port = master_port or free_port()
    ranks = list(range(world_size)) if ranks is None else list(ranks)
    processes = []
    for rank in ranks:
        variables = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                     "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                     **(env or {}), **((per_rank_env or {}).get(rank, {}))}
        processes.append((rank, subprocess.Popen(
            [sys.executable, str(_script(script)), *map(str, args)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=base_env({**dump_env(timeout), **variables}), cwd=str(ROOT),
            start_new_session=True)))
    deadline = time.monotonic() + timeout
    results, hung = [], []
    for rank, process in processes:
        try:
            output, _ = process.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill_tree(process.pid, stacks=True)
            output = collect_after_kill(process)
            hung.append(rank)
        results.append(RankResult(rank, process.returncode, output))
    if hung:
        shown = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
        pytest.fail(f"{Path(script).name}: rank(s) {hung} still running after {timeout:g} s (killed)\n{shown}")
    return results


def run_torchrun(script, nproc: int, *args: str, torchrun_args: Sequence[str] = (),
                 env: Optional[Mapping[str, str]] = None, timeout: float = 180.0,
                 check: bool = True) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node nproc [torchrun_args] script args`` on this host, killed (with
    every worker: its own session) after ``timeout``."""
    torchrun = Path(sys.executable).parent / "torchrun"
    command = [str(torchrun), "--nproc-per-node", str(nproc), "--master-port", str(free_port()), *torchrun_args,
               str(_script(script)), *map(str, args)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=base_env({**dump_env(timeout), **(env or {})}), cwd=str(ROOT),
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid, stacks=True)
        output = collect_after_kill(process)
        pytest.fail(f"torchrun {Path(script).name} hung: killed after {timeout:g} s\n{output[-12000:]}")
    result = subprocess.CompletedProcess(command, process.returncode, output, "")
    if check and process.returncode != 0:
        pytest.fail(f"torchrun {Path(script).name} {' '.join(map(str, args))} exited with {process.returncode}\n"
                    f"{output[-8000:]}")
    return result
