"""Which launcher started this process, read from the variables launchers set.

* ``"mpi"``: an MPI launcher (MPICH's hydra, Open MPI, Intel MPI, Slurm with PMI): the ranks
  are MPI's, and MPI moves the bytes. What commlib always did.
* ``"env"``: a launcher that sets torch's variables and no MPI's (torchrun,
  ``torch.multiprocessing.spawn`` scripts that export them, Kubernetes operators, Slurm scripts
  that export ``RANK``/``WORLD_SIZE``): the ranks meet through a store and talk over sockets.
* ``"none"``: neither; a single process (``commlib.init()`` makes a group of one, over MPI as
  before).

Decided before MPI is initialised: outside an MPI launch, importing ``mpi4py.MPI`` must not start
the MPI library (a singleton MPICH opens listening ports of its own, and a job that is not an MPI
job should not have them). :func:`keep_mpi_uninitialized` tells mpi4py so; commlib's package
calls it before anything imports ``mpi4py.MPI`` - by importing this module, which calls it once.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Optional

__all__ = ["detect_launcher", "keep_mpi_uninitialized", "MPI_VARIABLES", "ENV_VARIABLES"]

# What MPI launchers set in every rank's environment (any one is enough).
MPI_VARIABLES = ("PMI_RANK", "PMI_SIZE", "PMI_FD", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS",
                 "HYDI_CONTROL_FD", "MV2_COMM_WORLD_SIZE")
# What torch's launchers set (all of them, for "env").
ENV_VARIABLES = ("RANK", "WORLD_SIZE")


def detect_launcher(environ: Optional[Mapping[str, str]] = None) -> str:
    """``"mpi"``, ``"env"`` or ``"none"`` (see the module docstring)."""
    environ = os.environ if environ is None else environ
    if any(name in environ for name in MPI_VARIABLES):
        return "mpi"
    if all(name in environ for name in ENV_VARIABLES):
        return "env"
    return "none"


def keep_mpi_uninitialized(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Outside an MPI launch with torch's variables set, make importing ``mpi4py.MPI`` leave MPI
    uninitialised (``mpi4py.rc.initialize = False``), unless the program imported it already or
    asked otherwise (``MPI4PY_RC_INITIALIZE``). Returns whether it did."""
    environ = os.environ if environ is None else environ
    if detect_launcher(environ) != "env" or "mpi4py.MPI" in sys.modules or "MPI4PY_RC_INITIALIZE" in environ:
        return False
    import mpi4py

    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    return True


# Importing commlib imports this module first (see commlib/__init__.py).
keep_mpi_uninitialized()
