"""Finding each other for the "commlib" torch backend: torch's ranks are MPI's.

The backend needs MPI ranks: launch under ``mpiexec``. ``dist.init_process_group("commlib",
rank=, world_size=, store=)`` works too, but rank and world_size must equal MPI's (checked).
A group's timeout is the shorter of torch's ``timeout=`` and commlib's (``COMMLIB_TIMEOUT``,
300 s); the default group reuses ``commlib.init()``'s world group if it exists already.
The store's address: ``MASTER_ADDR``/``MASTER_PORT`` when set, else found over MPI (no DNS).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import cast

import torch.distributed as dist

import commlib
from commlib import InvalidUsageError

from .backend import BACKEND_NAME, CommlibProcessGroup

__all__ = ["create_process_group", "rendezvous_store", "init_process_group"]


def create_process_group(options, _backend_options=None) -> CommlibProcessGroup:
    """The factory torch calls (registered by ``backend.register``) for each new "commlib" group."""
    # torch always passes a timeout (30 min unless given): a shorter one is honoured, a longer one
    # is capped by commlib's (COMMLIB_TIMEOUT), which a group that already exists keeps anyway.
    requested = options.timeout.total_seconds() if options.timeout else None
    config_timeout = commlib.load_config().timeout
    timeout = min(requested, config_timeout) if requested and requested > 0 else config_timeout
    world = commlib.init(timeout=timeout)
    members = list(options.global_ranks_in_group)
    rank, size = options.group_rank, options.group_size
    if not members:  # the default group: torch's ranks must be MPI's
        if (rank, size) != (world.rank, world.size):
            raise InvalidUsageError(
                f"the {BACKEND_NAME!r} backend takes its ranks from MPI (launch under mpiexec): MPI "
                f"says rank {world.rank} of {world.size}, but init_process_group got rank={rank}, "
                f"world_size={size}; expected the same numbers"
            )
        return CommlibProcessGroup(world)
    # A subgroup's members are torch's global ranks, taken as MPI's: check that they agree.
    global_rank = dist.get_rank() if dist.is_initialized() else world.rank
    if global_rank != world.rank or members[rank] != world.rank:
        raise InvalidUsageError(
            f"the {BACKEND_NAME!r} backend takes its ranks from MPI: this process is MPI rank "
            f"{world.rank}, but torch's global rank is {global_rank} and the new group places it "
            f"at rank {rank} of {members}; expected torch's ranks to be MPI's (launch under mpiexec)"
        )
    if members == list(range(world.size)):
        sub = world.comm.Dup()
    else:  # only members get here (torch skips the others): a group-collective create
        # A group's communicator is an intracommunicator (typed MPI.Comm by ProcessGroup).
        sub = world.comm.Create_group(world.comm.group.Incl(members), tag=17)  # type: ignore[attr-defined]
    name = f"torch-{'-'.join(map(str, members))}"
    return CommlibProcessGroup(commlib.ProcessGroup(sub, timeout=timeout, config=world.config,
                                                    debug=world.debug, name=name,
                                                    segment_bytes=world.segment_bytes))


def rendezvous_store(comm=None, timeout: timedelta = timedelta(seconds=300)) -> "dist.TCPStore":
    """A TCPStore on rank 0. Collective over ``comm`` (default ``MPI.COMM_WORLD``).

    As torch does, ``MASTER_ADDR`` (rank 0's host, as the others reach it) and ``MASTER_PORT``
    are honoured when set. Otherwise the port is picked by the OS and broadcast over MPI, and
    each rank reaches rank 0 at the first of rank 0's interface addresses that answers (no DNS
    needed: cluster host names often do not resolve), see :mod:`commlib.root_address`.
    """
    from mpi4py import MPI

    from commlib.root_address import reachable_root_address

    comm = comm or MPI.COMM_WORLD
    master_addr, master_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    port = _port_from_env(master_port) if master_port else 0
    host = master_addr or reachable_root_address(comm)
    if comm.Get_rank() == 0:
        store = dist.TCPStore(host, port, comm.Get_size(), True, timeout, wait_for_workers=False)
        comm.bcast(store.port, root=0)
        return store
    port = comm.bcast(None, root=0)
    return dist.TCPStore(host, port, comm.Get_size(), False, timeout)


def _port_from_env(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise InvalidUsageError(f"MASTER_PORT={text!r}: expected a TCP port number (0-65535)")
    return port


def init_process_group(**kwargs) -> CommlibProcessGroup:
    """Under mpiexec: ``dist.init_process_group("commlib")`` with MPI's rank and size and a store."""
    world = commlib.init()
    if "store" not in kwargs and "init_method" not in kwargs:
        kwargs["store"] = rendezvous_store()
    dist.init_process_group(BACKEND_NAME, rank=world.rank, world_size=world.size, **kwargs)
    # Registered with extended_api=True: torch keeps the group we created as its default group.
    return cast(CommlibProcessGroup, dist.distributed_c10d._get_default_group())
