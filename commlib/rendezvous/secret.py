"""The job secret: what every rank of one job knows and nothing else on the network does.

Every connection commlib accepts (the TCP store, the socket transport's links, and whatever else
listens) proves the secret in a challenge-response handshake (:mod:`.handshake`) before any
other byte is read or answered. Where the secret comes from, in this order:

1. ``COMMLIB_JOB_SECRET`` (at least 16 characters), the same on every rank;
2. ``COMMLIB_JOB_SECRET_FILE``: a regular file owned by this user and readable by nobody else
   (mode 0600 or 0400; anything else is refused, as ssh refuses a private key other users
   can read), its first line the secret;
3. neither: rank 0 generates one and hands it to the others over the launcher's own channel
   (:func:`share_secret`, collective over a :class:`commlib.rendezvous.Rendezvous`).

What (3) protects against depends on that channel. Under ``mpiexec`` it is MPI itself, which
nothing outside the job can join: strangers on the network are kept out. Through a store
(torchrun's, or ours started without a secret) the secret crosses the store's connection in the
clear, and anything that can connect to the store while the job starts can read it: such a job
is protected against the accidents (a stale rank of another job reusing a port after a restart,
a ``MASTER_ADDR`` pointing at the wrong job) but not against an attacker on the network who
watches for it. Set ``COMMLIB_JOB_SECRET(_FILE)`` when that matters.

The secret itself never travels in the handshake. Its *job id*, a one-way digest of it, does: it
lets a rank tell "another job's secret" from "a forged or replayed handshake" in its errors.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import stat
from typing import TYPE_CHECKING, Optional

from commlib.errors import InvalidUsageError
from commlib.rendezvous.handshake_core import job_id_of

if TYPE_CHECKING:
    from commlib.rendezvous.interface import Rendezvous

__all__ = ["JobSecret", "MIN_SECRET_CHARS", "configured_secret", "secret_from_text", "read_secret_file",
           "generate_secret", "share_secret"]

MIN_SECRET_CHARS = 16
_KEY_LABEL = b"commlib job secret v1\0"
_MAX_FILE_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class JobSecret:
    """A job's secret key (32 bytes) and where it came from (for messages; never the key)."""

    key: bytes = dataclasses.field(repr=False)
    source: str = "generated"

    def __post_init__(self) -> None:
        if len(self.key) != 32:
            raise ValueError(f"a job secret's key is 32 bytes, got {len(self.key)}")

    @property
    def job_id(self) -> bytes:
        """8 bytes naming the job, derived one way from the key (safe to show and to send)."""
        return job_id_of(self.key)

    def describe(self) -> str:
        return f"job {self.job_id.hex()} (secret {self.source})"


def secret_from_text(text: str, source: str) -> JobSecret:
    """The secret a text names (what ``COMMLIB_JOB_SECRET`` holds); at least 16 characters."""
    text = text.strip()
    if len(text) < MIN_SECRET_CHARS:
        raise InvalidUsageError(f"the job secret from {source} has {len(text)} characters; expected at least "
                                f"{MIN_SECRET_CHARS} (e.g. python -c 'import secrets; print(secrets.token_hex(16))')")
    return JobSecret(hashlib.sha256(_KEY_LABEL + text.encode()).digest(), source)


def read_secret_file(path: str) -> JobSecret:
    """The secret in ``path``: a regular file of this user that nobody else may read."""
    name = f"COMMLIB_JOB_SECRET_FILE={path}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as error:
        raise InvalidUsageError(f"{name}: cannot open it ({error.strerror}); a symbolic link is refused too") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidUsageError(f"{name}: not a regular file")
        if info.st_mode & 0o077:
            raise InvalidUsageError(f"{name}: mode {stat.S_IMODE(info.st_mode):04o} lets other users read or change "
                                    f"it; chmod 600 {path}")
        if info.st_uid != os.geteuid():
            raise InvalidUsageError(f"{name}: owned by uid {info.st_uid}, not by this process's user "
                                    f"(uid {os.geteuid()})")
        data = os.read(fd, _MAX_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > _MAX_FILE_BYTES:
        raise InvalidUsageError(f"{name}: larger than {_MAX_FILE_BYTES} bytes; expected one line, the secret")
    lines = data.decode(errors="replace").splitlines()
    return secret_from_text(lines[0] if lines else "", f"file {path}")


def configured_secret(config) -> Optional[JobSecret]:
    """The secret ``config`` (a :class:`commlib.config.Config`) names, or None when neither
    ``COMMLIB_JOB_SECRET`` nor ``COMMLIB_JOB_SECRET_FILE`` is set."""
    text, path = config.job_secret, config.job_secret_file
    if text and path:
        raise InvalidUsageError("both COMMLIB_JOB_SECRET and COMMLIB_JOB_SECRET_FILE are set; set one")
    if text:
        return secret_from_text(text, "COMMLIB_JOB_SECRET")
    if path:
        return read_secret_file(path)
    return None


def generate_secret(source: str = "generated") -> JobSecret:
    return JobSecret(secrets.token_bytes(32), source)


def share_secret(rendezvous: "Rendezvous", configured: Optional[JobSecret]) -> JobSecret:
    """Collective: the one secret of the rendezvous' ranks.

    Every rank passes what it was configured with (:func:`configured_secret`). When all were,
    they must agree (compared by job id); when none was, rank 0 generates one and broadcasts it
    over the rendezvous (see the module docstring for what that protects against). A job where
    only some ranks were given a secret, or different ones, is refused on every rank, naming them.
    """
    ids = rendezvous.allgather(configured.job_id.hex() if configured is not None else None)
    if all(job_id is None for job_id in ids):
        key = rendezvous.broadcast(generate_secret().key if rendezvous.rank == 0 else None, root=0)
        return JobSecret(key, f"generated by rank 0, handed over the {rendezvous.kind or 'launcher'} rendezvous")
    if len(set(ids)) == 1:
        assert configured is not None
        return configured
    without = [rank for rank, job_id in enumerate(ids) if job_id is None]
    shown = "; ".join(f"rank {rank}: {'no secret' if job_id is None else 'job ' + job_id}"
                      for rank, job_id in enumerate(ids))
    why = (f"rank{'s' if len(without) > 1 else ''} {', '.join(map(str, without))} "
           f"{'have' if len(without) > 1 else 'has'} none" if without else "they differ")
    raise InvalidUsageError(f"rank {rendezvous.rank}: the job secret (COMMLIB_JOB_SECRET or COMMLIB_JOB_SECRET_FILE) "
                            f"must be set on every rank alike or on none, but {why}: {shown}")
