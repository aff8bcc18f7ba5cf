"""``Join``: training with uneven inputs across ranks (torch's ``torch.distributed.algorithms.Join``).

    with Join([model, averager]):          # our DDP, our averagers, or any Joinable
        for x, y in my_batches:            # ranks may have different numbers of batches
            loss_fn(model(x), y).backward(); optimizer.step()
    # every rank gets here; the model is the same on all of them

A rank that runs out of data leaves the loop and enters ``Join.__exit__``. There, once per
iteration the others still run, it takes part in the collectives they issue ("shadows" them):
each Joinable's ``JoinHook.main_hook`` issues the same collectives with neutral data (zero
gradients, zero parameter contributions). When every rank has joined, each hook's ``post_hook``
runs (DDP and the averagers make the model equal everywhere, from one of the last ranks to join).

How ranks learn who is still in: at the start of each of its iterations (DDP: each forward with
grad enabled; an averager: each ``average_parameters``) the first Joinable of the list calls
``Join.notify_join_context(self)``, which exchanges one small integer per rank (an allgather)
with the joined ranks' loop. One collective tells every rank who is active, who will reduce
gradients this iteration (a ``no_sync`` forward says it will not) and who asked to terminate;
torch spends up to three allreduces per iteration on the same facts.

Rules (as torch's): list every Joinable whose collectives run in the loop, in the order they
issue them within an iteration (``[model, averager]``), all on one process group; a Joinable
that is not first but is called before the first one in an iteration, or one used inside a Join
of its group that does not list it, raises ``RuntimeError`` on every rank (instead of leaving the
others waiting for a joined rank until their timeout). Differences from torch:
``notify_join_context`` returns the ``Join`` (or None) rather than a work handle; buffers
broadcast under Join come from the lowest active rank (rank 0 until it joins, as without Join;
torch takes the highest).
"""

from __future__ import annotations

import abc
from typing import ClassVar, List, Optional, Sequence

import numpy as np
import torch

from commlib import ReduceOp

__all__ = ["Join", "Joinable", "JoinHook"]

# One int64 per rank per iteration.
JOINED, JOINED_TERMINATE, ACTIVE_SYNC, ACTIVE_NO_SYNC = 0, -1, 1, 2


class JoinHook:
    """What a joined rank does: ``main_hook()`` once per iteration the others still run,
    ``post_hook(is_last_joiner)`` once everyone has joined."""

    def main_hook(self) -> None:
        pass

    def post_hook(self, is_last_joiner: bool) -> None:
        pass


class _JoinConfig:
    __slots__ = ("context", "is_first", "iteration_seen")

    def __init__(self, context: Optional["Join"] = None, is_first: bool = False):
        self.context = context
        self.is_first = is_first
        self.iteration_seen = 0  # the context's iteration when this Joinable last started one


class Joinable(abc.ABC):
    """Something whose collectives a joined rank must shadow. Subclasses call ``__init__``."""

    def __init__(self):
        self._join_config = _JoinConfig()

    @abc.abstractmethod
    def join_hook(self, **kwargs) -> JoinHook:
        """The hook a joined rank runs; ``kwargs`` are the ``Join``'s extra keyword arguments."""

    @property
    @abc.abstractmethod
    def join_device(self) -> torch.device:
        ...

    @property
    @abc.abstractmethod
    def join_process_group(self):
        ...


class Join:
    """Context manager for uneven inputs; ``joinables`` in the order they issue collectives.

    ``enable=False`` turns it into a no-op (inputs known to be even). With
    ``throw_on_early_termination=True`` the first rank to run out makes every rank raise
    ``RuntimeError`` in the same iteration instead of shadowing. Extra keyword arguments go to
    every Joinable's ``join_hook`` (DDP: ``divide_by_initial_world_size``, default True: the
    gradient of an iteration is the sum over the active ranks divided by the initial world size;
    False: by the number of ranks still active).
    """

    def __init__(self, joinables: Sequence[Joinable], enable: bool = True,
                 throw_on_early_termination: bool = False, **kwargs):
        self._joinables: List[Joinable] = list(joinables)
        if not self._joinables:
            raise ValueError("Join: the join context manager needs at least one Joinable")
        for joinable in self._joinables:
            if not isinstance(getattr(joinable, "_join_config", None), _JoinConfig):
                raise TypeError(f"Join: {type(joinable).__name__} is not a Joinable (or its __init__ did not "
                                f"call Joinable.__init__)")
        groups = {id(j.join_process_group) for j in self._joinables}
        if len(groups) > 1:
            raise ValueError("Join: all Joinables must use the same process group; got "
                             + ", ".join(f"{type(j).__name__}: {j.join_process_group!r}" for j in self._joinables))
        self._enable = bool(enable)
        self._throw = bool(throw_on_early_termination)
        self._hooks = [joinable.join_hook(**kwargs) for joinable in self._joinables]
        self.process_group = self._joinables[0].join_process_group
        self.rank, self.size = self.process_group.rank, self.process_group.size
        self.iteration = 0
        self.flags = np.full(self.size, ACTIVE_SYNC, np.int64)  # the last exchange's answer

    # -- what the Joinables ask --------------------------------------------------------------
    def active_ranks(self) -> List[int]:
        return [r for r in range(self.size) if self.flags[r] >= ACTIVE_SYNC]

    @property
    def active_count(self) -> int:
        return int((self.flags >= ACTIVE_SYNC).sum())

    def any_active_syncs(self) -> bool:
        return bool((self.flags == ACTIVE_SYNC).any())

    def source_rank(self) -> int:
        """The lowest active rank: where state that must be the same everywhere comes from."""
        active = self.active_ranks()
        return active[0] if active else 0

    # -- the protocol ----------------------------------------------------------------------
    _active: ClassVar[List["Join"]] = []  # the enabled Joins entered and not yet exited (see notify_join_context)

    def __enter__(self):
        for index, joinable in enumerate(self._joinables):
            joinable._join_config = _JoinConfig(self if self._enable else None, index == 0)
        if self._enable:
            Join._active.append(self)
        return self

    def _exchange(self, flag: int) -> np.ndarray:
        everyone = np.empty(self.size, np.int64)
        self.process_group.allgather(everyone, np.array([flag], np.int64))
        self.flags = everyone
        self.iteration += 1
        return everyone

    @staticmethod
    def notify_join_context(joinable: Joinable, *, syncs: bool = True) -> Optional["Join"]:
        """Called by a Joinable at the start of each of its iterations on a rank that has not
        joined. The first Joinable tells the others (and the joined ranks) that this rank is
        still in; ``syncs=False``: it will not reduce gradients this iteration (``no_sync``).
        Returns the active ``Join``, or None outside one."""
        config = getattr(joinable, "_join_config", None)
        if config is None or config.context is None:
            for active in Join._active:
                if active.process_group is joinable.join_process_group:
                    # A rank that joins would not shadow this Joinable's collectives: the others
                    # would wait for it until their timeout. Say so now, on every rank.
                    raise RuntimeError(
                        f"Join (rank {active.rank}): {type(joinable).__name__} is used inside a Join over "
                        f"its process group that does not list it; list every Joinable the loop uses, "
                        f"in the order they issue collectives, e.g. Join([model, averager])")
            return None
        context = config.context
        if config.is_first:
            flags = context._exchange(ACTIVE_SYNC if syncs else ACTIVE_NO_SYNC)
            if (flags == JOINED_TERMINATE).any():
                raise RuntimeError(f"Join (rank {context.rank}): rank(s) "
                                   f"{np.flatnonzero(flags == JOINED_TERMINATE).tolist()} exhausted their inputs "
                                   f"and throw_on_early_termination=True: raising on every rank")
        elif config.iteration_seen >= context.iteration:  # the first Joinable has not started a new one
            raise RuntimeError(
                f"Join (rank {context.rank}): {type(joinable).__name__} started an iteration before "
                f"{type(context._joinables[0]).__name__}, the first Joinable of the list, did: list the "
                f"Joinables in the order they issue collectives within an iteration")
        config.iteration_seen = context.iteration
        return context

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            if not self._enable or exc_type is not None:
                return None  # an exception propagates as it is
            is_last_joiner = True
            while True:
                flags = self._exchange(JOINED_TERMINATE if self._throw else JOINED)
                if not (flags >= ACTIVE_SYNC).any():
                    break
                if self._throw:
                    raise RuntimeError(f"Join (rank {self.rank}): this rank exhausted its inputs while ranks "
                                       f"{self.active_ranks()} still have some, and "
                                       f"throw_on_early_termination=True: raising on every rank")
                for hook in self._hooks:
                    hook.main_hook()
                is_last_joiner = False
            for hook in self._hooks:
                hook.post_hook(is_last_joiner)
            return None
        finally:
            for joinable in self._joinables:
                joinable._join_config = _JoinConfig()
            if self in Join._active:
                Join._active.remove(self)

    @staticmethod
    def last_joiner_rank(process_group, is_last_joiner: bool) -> int:
        """The highest rank among the last to join (collective): the source of the final model."""
        candidate = np.array([process_group.rank if is_last_joiner else -1], np.int64)
        process_group.allreduce(candidate, ReduceOp.MAX)
        return int(candidate[0])
