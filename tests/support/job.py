"""PYTHONPATH=. mpiexec -n P python -m tests.support.job SCRIPT [ARG ...] [--- SCRIPT [ARG ...]] ...

Several rank scripts in one mpiexec job, one after the other, each run as if it had been started
alone (its own ``sys.argv``, ``__name__ == "__main__"``, its own :class:`Checker
<tests.support.verdict.Checker>` and verdict). What they share is the job's start-up: one
mpiexec, one interpreter per rank, one import of torch (about 2 s of CPU per rank), one
``MPI_Init`` and one ``commlib.init`` (``init`` is idempotent: the first script's call makes the
world group, the later ones get it back, so scripts that run together must ask for the same
timeout and segment size). After each script the ranks agree on its exit status over
``MPI_COMM_WORLD`` and torch's default group, if the script left one, is destroyed.

Rank 0 prints ``job: begin SCRIPT ARGS`` before each script and ``job: end SCRIPT ARGS: exit
codes [...]`` (one per rank) after it; :class:`tests.support.mpirun.Job` reads them to give each
script its own pytest verdict. The job exits with the worst status. A script that raises (rather
than exiting) aborts the whole job, as it would alone (commlib's abort-on-uncaught-exception):
the scripts after it do not run, and their tests say so.
"""

from __future__ import annotations

import runpy
import sys
import time
from typing import List, Sequence, Tuple

SEPARATOR = "---"
MARK = "job:"


def split_parts(argv: Sequence[str]) -> List[Tuple[str, List[str]]]:
    """``[(script, args), ...]`` from ``SCRIPT ARG ... --- SCRIPT ARG ...``."""
    parts: List[Tuple[str, List[str]]] = []
    current: List[str] = []
    for word in [*argv, SEPARATOR]:
        if word != SEPARATOR:
            current.append(word)
        elif current:
            parts.append((current[0], current[1:]))
            current = []
    return parts


def label(script: str, args: Sequence[str]) -> str:
    """How the marker lines name a part: the script's file name and its arguments."""
    return " ".join([script.rsplit("/", 1)[-1], *args])


def _exit_code(stopped: SystemExit) -> int:
    if stopped.code is None:
        return 0
    if isinstance(stopped.code, int):
        return stopped.code
    print(stopped.code, file=sys.stderr, flush=True)  # sys.exit("message"), as the interpreter would
    return 1


def _destroy_torch_default_group() -> None:
    torch_distributed = sys.modules.get("torch.distributed")
    if torch_distributed is not None and torch_distributed.is_initialized():
        torch_distributed.destroy_process_group()


def _wait(request) -> None:
    """Wait for an MPI request without spinning: MPICH busy-polls in blocking calls, and a rank
    that is done early would take a core from the ranks still working (2 cores, up to 8 ranks)."""
    while not request.Test():
        time.sleep(0.002)


def _exit_codes(comm, code: int) -> List[int]:
    import numpy as np

    mine, everyone = np.array([code], np.int64), np.empty(comm.Get_size(), np.int64)
    _wait(comm.Iallgather(mine, everyone))
    return [int(value) for value in everyone]


def main(argv: Sequence[str]) -> int:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    worst = 0
    for script, args in split_parts(argv):
        name = label(script, args)
        _wait(comm.Ibarrier())  # the previous part has ended on every rank
        if comm.Get_rank() == 0:
            print(f"{MARK} begin {name}", flush=True)
        sys.argv = [script, *args]
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as stopped:
            code = _exit_code(stopped)
        codes = _exit_codes(comm, code)
        _destroy_torch_default_group()
        if comm.Get_rank() == 0:
            print(f"{MARK} end {name}: exit codes {codes}", flush=True)
        worst = max(worst, *codes)
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
