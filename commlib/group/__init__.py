"""``ProcessGroup``: the collectives and point-to-point messages of one set of ranks."""

from commlib.group.process_group import ProcessGroup

__all__ = ["ProcessGroup"]
