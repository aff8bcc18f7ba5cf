"""Single copies between the processes of one host: Linux's cross-memory attach (CMA).

``process_vm_readv`` copies from another process's memory into ours and ``process_vm_writev`` the
other way, one kernel copy with no shared mapping: how the MPI library moves a large message
within a host, and how ``shm_direct``'s two-rank broadcast, scatter and gather split one copy
between both ranks (the rank holding the bytes writes part of the other's buffer while the other
reads the rest).

Whether a process may do it depends on the system, not on us: the ptrace access check (Yama's
``ptrace_scope`` allows only descendants at 1), container seccomp profiles (which often refuse
both calls), other kernels. So a group finds out once, collectively (:func:`probe_cross_memory`):
each rank reads a token from every peer's private memory and compares it with the value that
peer announced; only when every rank succeeded with every peer does any rank use it, so all
choose the same path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Optional, Sequence

import numpy as np

from commlib.errors import CommError

__all__ = ["CrossMemory", "probe_cross_memory"]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def _load_calls():
    """``(process_vm_readv, process_vm_writev)`` from the C library, or None where there are none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        calls = (libc.process_vm_readv, libc.process_vm_writev)
    except (OSError, AttributeError):
        return None
    for call in calls:
        call.restype = ctypes.c_ssize_t
        call.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec),
                         ctypes.c_ulong, ctypes.c_ulong]
    return calls


class CrossMemory:
    """Copies between this process and the processes ``pids`` (by rank) of one host."""

    def __init__(self, pids: Sequence[int], describe_peer=str):
        calls = _load_calls()
        if calls is None:
            raise OSError("no process_vm_readv/process_vm_writev in the C library")
        self._readv, self._writev = calls
        self.pids = list(pids)
        self._describe_peer = describe_peer  # rank -> "rank R (pid P on HOST)", for errors

    def read(self, peer: int, address: int, destination: np.ndarray) -> None:
        """``destination`` (contiguous) = ``destination.nbytes`` bytes at ``address`` in ``peer``."""
        self._copy(self._readv, "read from", peer, destination, address)

    def write(self, peer: int, source: np.ndarray, address: int) -> None:
        """``source`` (contiguous) into ``peer``'s memory at ``address``."""
        self._copy(self._writev, "write to", peer, source, address)

    def _copy(self, call, verb: str, peer: int, local: np.ndarray, address: int) -> None:
        done, nbytes = 0, local.nbytes
        base = local.ctypes.data
        while done < nbytes:  # the kernel may copy less than asked (a partial transfer)
            here = _IoVec(base + done, nbytes - done)
            there = _IoVec(address + done, nbytes - done)
            got = call(self.pids[peer], ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
            if got <= 0:
                code = ctypes.get_errno() if got < 0 else 0
                raise CommError(f"cross-memory {verb} {self._describe_peer(peer)} failed after {done} of "
                                f"{nbytes} bytes at {address + done:#x}: "
                                f"{os.strerror(code) if code else 'no progress'}")
            done += got


def probe_cross_memory(rendezvous, transport) -> Optional[CrossMemory]:
    """Collective over ``rendezvous`` (the ranks of ``transport``, one host): a :class:`CrossMemory`
    on every rank if every rank can read every peer's memory, else None on every rank."""
    token = np.array([(os.getpid() << 20) ^ id(transport) ^ 0x5A5A5A5A], np.int64)
    announced = rendezvous.allgather((token.ctypes.data, int(token[0])))  # (address, value) by rank
    works = True
    cross: Optional[CrossMemory] = None
    try:
        cross = CrossMemory(transport.pids, transport.describe_peer)
        seen = np.zeros(1, np.int64)
        for peer in range(rendezvous.size):
            if peer != rendezvous.rank:
                seen[0] = 0
                address, value = announced[peer]
                cross.read(peer, address, seen)
                works = works and int(seen[0]) == value
    except (OSError, CommError):
        works = False
    # Every rank keeps its token alive until all have read it.
    everyone = rendezvous.all_agree(works)
    del token
    return cross if everyone else None
