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

Only numpy and mpi4py are needed to import it; torch and cupy are optional.
"""

from .algorithms import algorithm_names as _algorithm_names
from .algorithms import register_algorithm
from .config import Config, load_config
from .errors import (CollectiveMismatchError, CommError, CommTimeoutError, GroupAbortedError,
                     InvalidUsageError, PeerExitedError)
from .group import ProcessGroup
from .ops import ReduceOp
from .p2p import ANY_SOURCE
from .runtime import empty, init, is_initialized, shutdown, world
from .topology import Topology
from .transports.interface import Pending, Transport
from .transports.view import RankView
from .work import Work, WorkHandle

__version__ = "0.1.0"

__all__ = [
    "init", "world", "is_initialized", "shutdown", "empty", "algorithms", "register_algorithm",
    "ANY_SOURCE", "ProcessGroup", "ReduceOp", "Work", "WorkHandle", "Transport", "Pending", "Topology", "RankView",
    "Config", "load_config",
    "CommError", "CommTimeoutError", "InvalidUsageError", "CollectiveMismatchError",
    "GroupAbortedError", "PeerExitedError",
]


def algorithms(collective: str = "allreduce"):
    """Names of ``collective``'s algorithms (for ``algorithm=``; ``"auto"`` is also accepted)."""
    return _algorithm_names(collective)
