"""commlib: collective communication over MPI (CPU) and NCCL (GPU), written in Python.

Quick tour::

    import commlib
    pg = commlib.init()                      # under mpiexec
    pg.allreduce(array)                      # in place, sum
    grads = pg.alloc(1 << 20)                # symmetric: allreduce reads the peers' memory in place
    pg.allgather(out, array, algorithm="bruck")
    pg.send(array, dst=1); source = pg.recv(array, commlib.ANY_SOURCE)
    work = pg.allreduce(array, commlib.ReduceOp.AVG, algorithm="ring", async_op=True)
    work.wait()

Only numpy and mpi4py are needed to import it; torch and cupy are optional. Under mpiexec the
ranks are MPI's; under torchrun (or anything that sets ``RANK`` and ``WORLD_SIZE`` without MPI)
they meet through a store and talk over sockets (see :func:`commlib.init`).
"""

# First, before anything imports mpi4py.MPI: importing it decides whether that initialises MPI.
import commlib.platform.launcher  # noqa: F401  # isort: skip

from commlib.algorithms.registry import algorithm_names as _algorithm_names
from commlib.algorithms.registry import register_algorithm
from commlib.config import Config, load_config
from commlib.errors import (CollectiveMismatchError, CommError, CommTimeoutError, GroupAbortedError, InvalidUsageError,
                            JobStateLostError, PeerExitedError)
from commlib.execution.work import Work, WorkHandle
from commlib.group.p2p import ANY_SOURCE
from commlib.group.process_group import ProcessGroup
from commlib.ops import ReduceOp
from commlib.runtime import empty, group_over_store, init, is_initialized, shutdown, world
from commlib.topology import Topology
from commlib.transports.interface import Pending, Transport
from commlib.transports.view import RankView

__version__ = "0.1.0"

__all__ = [
    "init", "world", "is_initialized", "shutdown", "empty", "group_over_store", "algorithms", "register_algorithm",
    "ANY_SOURCE", "ProcessGroup", "ReduceOp", "Work", "WorkHandle", "Transport", "Pending", "Topology", "RankView",
    "Config", "load_config",
    "CommError", "CommTimeoutError", "InvalidUsageError", "CollectiveMismatchError",
    "GroupAbortedError", "PeerExitedError", "JobStateLostError",
]


def algorithms(collective: str = "allreduce"):
    """Names of ``collective``'s algorithms (for ``algorithm=``; ``"auto"`` is also accepted)."""
    return _algorithm_names(collective)
