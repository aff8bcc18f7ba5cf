"""What a joined rank does for our DDP (see :mod:`ddp.join`): the collectives of one forward and
one backward of the others, with nothing of its own to contribute, and the final model at the end."""

from __future__ import annotations

from .join import Join, JoinHook
from .verify import broadcast_tensors

__all__ = ["DDPJoinHook"]


class DDPJoinHook(JoinHook):
    def __init__(self, model):
        self.model = model

    def main_hook(self) -> None:
        model = self.model
        join = model._join_config.context
        # Forward: the buffer broadcast every active rank issues (from the lowest active rank).
        if model.broadcast_buffers and model._buffers_to_sync:
            broadcast_tensors(model.process_group, model._buffers_to_sync, root=join.source_rank())
        # Backward: every bucket with zero gradients (the sum over the active ranks is theirs
        # alone), unless the active ranks run no_sync() this iteration.
        if join.any_active_syncs():
            model.reducer.shadow_backward()

    def post_hook(self, is_last_joiner: bool) -> None:
        model = self.model
        model.reducer.set_divisor(None)
        # Joined ranks stopped stepping: everyone takes the model of one of the last to join.
        source = Join.last_joiner_rank(model.process_group, is_last_joiner)
        broadcast_tensors(model.process_group, [p.data for p in model.module.parameters()]
                          + list(model.module.buffers()), root=source)
