"""Shared memory among the ranks of one host: one file per rank, mapped by every rank of the host.

Finding each other, for memory: collectively over the ranks of one host (a host-local
:class:`~commlib.rendezvous.interface.Rendezvous`: under MPI ``MPI_Comm_split_type`` with
``COMM_TYPE_SHARED``), every rank creates its own file in ``/dev/shm`` (``O_EXCL``, a name
with its pid and a random token), the paths are exchanged, every rank maps every file, and once
all of them have (an agreement), each rank unlinks its own file. From then on the memory exists
only as mappings: a rank killed later, even by SIGKILL, leaves nothing in ``/dev/shm``, and the
pages go back to the system when the last process holding a mapping ends. No MPI window is
involved (see :mod:`commlib.reliability.teardown`: ``MPI_Win_free`` is collective and a leftover window
breaks ``MPI_Finalize`` over OFI); each rank unmaps alone, whenever it wants.

Files are sparse: ``ftruncate`` reserves addresses, not memory; a page costs memory only once
written (or populated with :func:`populate`), and :func:`release` gives it back.

Used by the progress board (one small file, by the host's first rank) and by the shared-memory
transport (one segment per rank: its flags, staging areas and symmetric buffers).
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import sys
import tempfile
import threading
from typing import List, NamedTuple, Optional

from commlib.rendezvous.interface import Rendezvous

__all__ = ["HostFiles", "map_host_files", "shared_directory", "populate", "release", "fence", "fence_lock",
           "PAGE_BYTES"]

PAGE_BYTES = mmap.PAGESIZE
# Linux madvise advice values that Python 3.11's mmap module does not name yet (Linux 5.14+).
_MADV_POPULATE_READ = 22
_MADV_POPULATE_WRITE = 23


class HostFiles(NamedTuple):
    """What :func:`map_host_files` returns on every rank of the host (indexed by host rank)."""

    mappings: List[Optional[mmap.mmap]]  # None where that rank contributed no file
    pids: List[int]
    hostname: str
    host_rank: int
    fds: Optional[List[Optional[int]]] = None  # open descriptors of the files, with keep_fds (caller closes)
    # With peers_writable_from: each peer's file from that offset on, mapped read-write (None: own)
    tails: Optional[List[Optional[mmap.mmap]]] = None


def shared_directory() -> str:
    """Node-local memory when there is such a file system (Linux), else the temporary directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def map_host_files(host: Rendezvous, nbytes: int, *, kind: str, peers_writable: bool = False,
                   peers_writable_from: Optional[int] = None, keep_fds: bool = False) -> Optional[HostFiles]:
    """Collective over ``host`` (the ranks of one host): each rank's file of ``nbytes`` (none for 0), mapped by all.

    This rank's own file is mapped read-write; the others read-only unless ``peers_writable``
    (a read-only mapping turns a stray write into a crash instead of silent corruption of a
    peer's data). ``peers_writable_from`` (page-aligned): a peer's file that goes beyond it is
    mapped in two parts, ``mappings`` up to there (read-only) and ``tails`` from there to its end
    (read-write: the part peers may write).
    Returns None on every rank when any rank failed (each says why on stderr).
    ``keep_fds``: the descriptors stay open in ``fds`` (to hand a mapping to another process).
    """
    host_rank = host.rank
    path, error = None, None
    if nbytes > 0:
        path = os.path.join(shared_directory(), f"commlib-{kind}-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
        except OSError as exc:
            path, error = None, exc
    entries = host.allgather((path, nbytes, os.getpid(), error is not None))
    mappings: List[Optional[mmap.mmap]] = [None] * len(entries)
    tails: List[Optional[mmap.mmap]] = [None] * len(entries)
    fds: List[Optional[int]] = [None] * len(entries)
    if not any(failed for *_, failed in entries):
        for peer, (peer_path, peer_bytes, _pid, _failed) in enumerate(entries):
            if peer_bytes == 0:
                continue
            writable = peer == host_rank or peers_writable
            tail_from = peers_writable_from if peer != host_rank and peers_writable_from is not None \
                and peers_writable_from < peer_bytes else None
            try:
                fd = os.open(peer_path, os.O_RDWR if writable or tail_from is not None else os.O_RDONLY)
                try:
                    # With a tail, two mappings that do not overlap: a page mapped twice would count
                    # twice in this process's RSS.
                    mappings[peer] = mmap.mmap(fd, peer_bytes if tail_from is None else tail_from,
                                               access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
                    if tail_from is not None:
                        tails[peer] = mmap.mmap(fd, peer_bytes - tail_from, access=mmap.ACCESS_WRITE,
                                                offset=tail_from)
                finally:
                    if keep_fds:
                        fds[peer] = fd
                    else:
                        os.close(fd)
            except OSError as exc:
                error = exc
                break
    everyone_mapped = host.all_agree(error is None)  # also: all have opened every file
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
    if error is not None:
        sys.stderr.write(f"commlib: host rank {host_rank} (pid {os.getpid()}) on {socket.gethostname()}: no "
                         f"shared {kind} memory ({type(error).__name__}: {error})\n")
    if not everyone_mapped:
        for mapping in mappings + tails:
            if mapping is not None:
                mapping.close()
        for kept in fds:
            if kept is not None:
                os.close(kept)
        return None
    return HostFiles(mappings, [pid for _path, _bytes, pid, _failed in entries], socket.gethostname(),
                     host_rank, fds if keep_fds else None, tails if peers_writable_from is not None else None)


def populate(mapping: mmap.mmap, offset: int, nbytes: int, *, write: bool) -> None:
    """Fault in the pages of ``[offset, offset + nbytes)`` now (``offset`` page-aligned).

    For writing, this allocates the file's pages: a full ``/dev/shm`` is an ``OSError`` here
    instead of a SIGBUS at the first store. For reading (a peer's segment), it fills this
    process's page table, so the first collective does not pay a fault per page.
    """
    if nbytes <= 0:
        return
    length = _page_round(nbytes)
    try:
        mapping.madvise(_MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ, offset, length)
    except OSError as exc:
        if exc.errno not in (22, 95):  # EINVAL / EOPNOTSUPP: a kernel before 5.14
            raise
        view = memoryview(mapping)[offset:offset + nbytes]
        try:
            if write:
                view[::PAGE_BYTES] = bytes(len(range(0, nbytes, PAGE_BYTES)))
            else:
                bytes(view[::PAGE_BYTES])
        finally:
            view.release()


def release(mapping: mmap.mmap, offset: int, nbytes: int) -> None:
    """Give the pages of ``[offset, offset + nbytes)`` of this rank's own file back (they read as zeros)."""
    if nbytes <= 0:
        return
    try:
        mapping.madvise(mmap.MADV_REMOVE, offset, _page_round(nbytes))
    except (OSError, AttributeError, ValueError):
        pass  # the memory stays allocated until the mapping goes: wasteful, not wrong


def _page_round(nbytes: int) -> int:
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier, from Python.

    Acquiring and releasing a lock executes an atomic read-modify-write (``lock cmpxchg`` /
    ``lock xadd`` on x86; acquire and release semantics elsewhere), which orders every load and
    store before it against every one after it. On x86 (total store order) plain stores already
    become visible in program order, so this is for the stores that are not ordered: the
    non-temporal and fast-string stores glibc's ``memcpy`` uses for large copies (numpy's copies).
    Costs about 60 ns.
    """
    fence_lock.acquire()
    fence_lock.release()
