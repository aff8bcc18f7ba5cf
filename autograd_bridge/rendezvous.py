"""Finding each other for the "commlib" torch backend: torch's ranks are MPI's.

The backend needs MPI ranks: launch under ``mpiexec``. ``dist.init_process_group("commlib",
rank=, world_size=, store=)`` works too, but rank and world_size must equal MPI's (checked).
A group's timeout is the shorter of torch's ``timeout=`` and commlib's (``COMMLIB_TIMEOUT``,
300 s); the default group reuses ``commlib.init()``'s world group if it exists already.
"""

from __future__ import annotations

import socket
from datetime import timedelta

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
        sub = world.comm.Create_group(world.comm.group.Incl(members), tag=17)
    name = f"torch-{'-'.join(map(str, members))}"
    return CommlibProcessGroup(commlib.ProcessGroup(sub, timeout=timeout, config=world.config,
                                                    debug=world.debug, name=name,
                                                    segment_bytes=world.segment_bytes))


def rendezvous_store(comm=None, timeout: timedelta = timedelta(seconds=300)) -> "dist.TCPStore":
    """A TCPStore on rank 0 (port picked by the OS), its address broadcast over MPI."""
    from mpi4py import MPI

    comm = comm or MPI.COMM_WORLD
    hosts = comm.allgather(MPI.Get_processor_name())
    host = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname())
    if comm.Get_rank() == 0:
        store = dist.TCPStore(host, 0, comm.Get_size(), True, timeout, wait_for_workers=False)
        comm.bcast((host, store.port), root=0)
        return store
    host, port = comm.bcast(None, root=0)
    return dist.TCPStore(host, port, comm.Get_size(), False, timeout)


def init_process_group(**kwargs) -> CommlibProcessGroup:
    """Under mpiexec: ``dist.init_process_group("commlib")`` with MPI's rank and size and a store."""
    world = commlib.init()
    if "store" not in kwargs and "init_method" not in kwargs:
        kwargs["store"] = rendezvous_store()
    dist.init_process_group(BACKEND_NAME, rank=world.rank, world_size=world.size, **kwargs)
    return dist.distributed_c10d._get_default_group()
