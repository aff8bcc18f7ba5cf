"""The one error hierarchy of commlib.

``CommError`` is the root; every failure the runtime raises is one of its subclasses, so a
training loop can catch communication failures with a single ``except``.
"""

__all__ = [
    "CommError",
    "CommTimeoutError",
    "InvalidUsageError",
    "CollectiveMismatchError",
    "GroupAbortedError",
    "PeerExitedError",
    "JobStateLostError",
]


class CommError(RuntimeError):
    """A collective could not complete."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective did not complete within the group's timeout.

    The message names the collective, its sequence number, this rank, the peer(s) never heard
    from and the byte count.
    """


class InvalidUsageError(CommError, ValueError):
    """The caller asked for something the runtime cannot do; raised before anything is sent."""


class CollectiveMismatchError(CommError):
    """Debug mode found that ranks called different collectives (or with different arguments)."""


class GroupAbortedError(CommError):
    """An earlier error left this group unusable; every later call raises this at once."""


class PeerExitedError(CommError):
    """A peer's process exited before it reached this collective: it can never complete.

    Found from the progress board while waiting (within milliseconds, not at the timeout); the
    message names the collective, its sequence number and the ranks that exited.
    """


class JobStateLostError(CommError):
    """Fault-tolerant training: a replica waits to join, but no live replica holds the job's
    state (every replica that trained it has left or exited), and a replica cannot catch up from
    disk. Raised by :class:`commlib.ft.Manager` at once, rather than at the join timeout; the
    message names the job's step and the replicas that held it.
    """
