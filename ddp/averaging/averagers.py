"""Model averagers: local SGD's periodic parameter averaging (torch's ``model_averaging``).

    averager = PeriodicModelAverager(period=8, warmup_steps=100)
    for x, y in batches:
        loss_fn(model(x), y).backward(); optimizer.step()
        averager.average_parameters(model.parameters())     # or PostLocalSGDOptimizer

``step`` counts calls. Nothing happens during the ``warmup_steps`` first ones (DDP averages
gradients then); after that, parameters are averaged over the group every ``period`` calls,
starting with the first call after warm-up.

Beyond torch's: every averager is a :class:`ddp.Joinable` (torch's hang under Join: a rank out
of data never calls them again): list it after the model, ``Join([model, averager])``; a joined
rank then sends zeros in the averaging collectives and the others divide by the number of ranks
still in. ``average_buffers=True`` also averages floating-point buffers (BatchNorm statistics).
``warmup_steps`` is checked against the post-local SGD hook of the same parameters. Bytes sent
are counted (``bytes_sent``), ``state_dict()`` keeps the step.
"""

from __future__ import annotations

import abc
from typing import List, Optional

import torch

from ddp.averaging.utils import average_tensors, tensors_to_average
from ddp.hooks.post_localsgd import check_warmup_agrees
from ddp.join import Join, Joinable, JoinHook
from ddp.stats import ByteCounter
from ddp.verify import broadcast_tensors

__all__ = ["ModelAverager", "PeriodicModelAverager"]


def check_count(value, name: str, who: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{who}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


class ModelAverager(Joinable, abc.ABC):
    """Base class: the step counter, Join support, buffers, byte counting, checkpoints.

    Subclasses implement ``_average(tensors, join, contribute)`` for the current ``step``."""

    def __init__(self, process_group=None, *, warmup_steps: int = 0, average_buffers: bool = False,
                 module: Optional[torch.nn.Module] = None):
        Joinable.__init__(self)
        if process_group is None:
            import commlib

            process_group = commlib.world()
        self.process_group = process_group
        self.warmup_steps = check_count(warmup_steps, "warmup_steps", type(self).__name__, 0)
        self.average_buffers = bool(average_buffers)
        self.module = module
        self.step = 0
        self.sent = ByteCounter()
        self._tensors: Optional[List[torch.Tensor]] = None  # what the last call averaged

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this averager has handed to collectives so far."""
        return self.sent.total

    def average_parameters(self, params) -> None:
        """Average ``params`` (parameters, parameter groups or a module) if this step is due; step += 1."""
        join = Join.notify_join_context(self)
        tensors = tensors_to_average(params, average_buffers=self.average_buffers, module=self.module,
                                     who=type(self).__name__)
        if self._tensors is None:
            check_warmup_agrees(tensors, self.warmup_steps, type(self).__name__)
        self._tensors = tensors
        self._average(tensors, join, contribute=True)
        self.step += 1

    def _shadow(self) -> None:
        """A joined rank's part of the others' ``average_parameters`` this iteration."""
        if self._tensors is None:
            raise RuntimeError(
                f"{type(self).__name__} (rank {self.process_group.rank}): this rank joined before ever calling "
                f"average_parameters, so it cannot know what the others average; call it at least once")
        self._average(self._tensors, self._join_config.context, contribute=False)
        self.step += 1

    def finish(self) -> None:
        """Complete any averaging still in flight (averagers that overlap it with the next step):
        call it before evaluating or saving the final model. Nothing to do for this one."""

    @abc.abstractmethod
    def _average(self, tensors: List[torch.Tensor], join: Optional[Join], contribute: bool) -> None:
        ...

    def _average_over(self, tensors, group, members, join, contribute) -> None:
        """Average ``tensors`` over ``group`` (ranks ``members`` of the process group)."""
        contributors = None
        if join is not None:
            active = set(join.active_ranks())
            contributors = sum(1 for r in members if r in active)
        average_tensors(tensors, group, contributors=contributors, contribute=contribute, counter=self.sent)

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])

    # -- Join ----------------------------------------------------------------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        return _AveragerJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self._tensors[0].device if self._tensors else torch.device("cpu")

    @property
    def join_process_group(self):
        return self.process_group


class _AveragerJoinHook(JoinHook):
    def __init__(self, averager: ModelAverager):
        self.averager = averager

    def main_hook(self) -> None:
        self.averager._shadow()

    def post_hook(self, is_last_joiner: bool) -> None:
        averager = self.averager
        averager.finish()
        if averager._tensors:
            # Joined ranks stopped training: everyone takes the parameters of a last joiner.
            source = Join.last_joiner_rank(averager.process_group, is_last_joiner)
            broadcast_tensors(averager.process_group, [t.data for t in averager._tensors], root=source)



class PeriodicModelAverager(ModelAverager):
    """Average over the whole group every ``period`` steps after ``warmup_steps`` (torch's)."""

    def __init__(self, period: int, warmup_steps: int = 0, process_group=None, *,
                 average_buffers: bool = False, module: Optional[torch.nn.Module] = None):
        super().__init__(process_group, warmup_steps=warmup_steps, average_buffers=average_buffers, module=module)
        self.period = check_count(period, "period", type(self).__name__, 1)

    def _average(self, tensors, join, contribute) -> None:
        if self.step >= self.warmup_steps and (self.step - self.warmup_steps) % self.period == 0:
            self._average_over(tensors, self.process_group, range(self.process_group.size), join, contribute)
