"""The barrier benchmark's #wrong catches a barrier that lets ranks out early (and only that one).

    mpiexec -n 4 python tests/mpi/bench_broken_barrier.py first_round_only ROWS.json

Registers a broken barrier algorithm, then runs ``python -m commlib.bench --collective barrier``
with it next to ``native`` (and MPI_Barrier); the exit status and the JSON rows are the bench's.
"""

import sys

import commlib
from commlib import bench


def no_wait(transport, *, segment_bytes=1 << 20):
    """Returns at once: every rank is out before the late one has entered."""


def first_round_only(transport, *, segment_bytes=1 << 20):
    """dissemination's distance-1 round alone: a barrier at P=2; at P>=3 rank r hears only from r-1."""
    size, rank = transport.size, transport.rank
    if size == 1:
        return
    token_out = transport.scratch(1, "uint8", slot=1)
    token_in = transport.scratch(1, "uint8", slot=2)
    token_out[...] = 0
    transport.exchange(((token_out, (rank + 1) % size),), ((token_in, (rank - 1) % size),))


if __name__ == "__main__":
    name, json_path = sys.argv[1], sys.argv[2]
    commlib.register_algorithm(name, {"no_wait": no_wait, "first_round_only": first_round_only}[name],
                               collective="barrier")
    sys.exit(bench.main(["--collective", "barrier", "-a", f"{name},native", "-n", "3", "-w", "1",
                         "--json", json_path]))
