"""Finding each other for the "commlib" torch backend.

Under ``mpiexec`` torch's ranks are MPI's: ``dist.init_process_group("commlib", rank=,
world_size=, store=)`` works, but rank and world_size must equal MPI's (checked), and groups are
MPI communicators. Launched without MPI (torchrun, ``torch.multiprocessing.spawn``, ``env://``,
``tcp://``, ``file://``), the groups meet through the store torch hands the backend (each group
its own prefixed store) and talk over commlib's sockets, with shared memory inside a host.
A group's timeout is the shorter of torch's ``timeout=`` and commlib's (``COMMLIB_TIMEOUT``,
300 s); the default group reuses ``commlib.init()``'s world group if it exists already; the
commlib groups under subgroups are made in :mod:`.subgroups`.
The store's address: ``MASTER_ADDR``/``MASTER_PORT`` when set, else found over MPI (no DNS).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import cast

import torch.distributed as dist

import commlib
from commlib import InvalidUsageError
from commlib.platform.launcher import detect_launcher

from autograd_bridge.backend.process_group import BACKEND_NAME, CommlibProcessGroup
from autograd_bridge.backend.subgroups import subgroup, timeout_for

__all__ = ["create_process_group", "rendezvous_store", "init_process_group", "register"]


def create_process_group(options, _backend_options=None) -> CommlibProcessGroup:
    """The factory torch calls (registered by ``backend.register``) for each new "commlib" group.

    torch names the group (``_set_group_name``, ``_set_group_desc``) once this returns."""
    timeout = timeout_for(options.timeout.total_seconds() if options.timeout else None)
    members = list(options.global_ranks_in_group)
    rank, size = options.group_rank, options.group_size
    if _without_mpi():
        return _group_over_torch_store(options.store, members, rank, size, timeout)
    world = commlib.init(timeout=timeout)
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
    return CommlibProcessGroup(subgroup(world, members, timeout))


def _without_mpi() -> bool:
    """Whether this job's ranks are not MPI's: commlib's world met through a store, or there is
    none yet and no MPI launcher started this process."""
    if commlib.is_initialized():
        return commlib.world().comm is None
    return detect_launcher() != "mpi"


def _group_over_torch_store(store, members, rank: int, size: int, timeout: float) -> CommlibProcessGroup:
    if not members:  # the default group: commlib's world too, if there is none yet
        if not commlib.is_initialized():
            return CommlibProcessGroup(commlib.init(store=store, rank=rank, world_size=size, timeout=timeout))
        world = commlib.world()
        if (rank, size) != (world.rank, world.size):
            raise InvalidUsageError(f"the {BACKEND_NAME!r} backend: commlib's world is rank {world.rank} of "
                                    f"{world.size}, but init_process_group got rank={rank}, world_size={size}")
        return CommlibProcessGroup(world)
    # torch hands each group a store of its own (a PrefixStore): the group meets there.
    name = f"torch-{'-'.join(map(str, members))}"
    return CommlibProcessGroup(commlib.group_over_store(store, rank, size, timeout=timeout, name=name,
                                                        prefix=f"commlib/{name}"))


def rendezvous_store(comm=None, timeout: timedelta = timedelta(seconds=300)) -> "dist.TCPStore":
    """A TCPStore on rank 0. Collective over ``comm`` (default ``MPI.COMM_WORLD``).

    As torch does, ``MASTER_ADDR`` (rank 0's host, as the others reach it) and ``MASTER_PORT``
    are honoured when set. Otherwise the port is picked by the OS and broadcast over MPI, and
    each rank reaches rank 0 at the first of rank 0's interface addresses that answers (no DNS
    needed: cluster host names often do not resolve), see :mod:`commlib.rendezvous.root_probe`.
    """
    from mpi4py import MPI

    from commlib.rendezvous.root_probe import reachable_root_address

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


def register() -> None:
    """Register the backend name (done on ``import autograd_bridge``); idempotent."""
    if hasattr(dist.Backend, BACKEND_NAME.upper()):
        return
    # torch 2.13 iterates ``devices``: a plain string would register one device per character.
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True,
                                  devices=["cpu", "cuda"])
