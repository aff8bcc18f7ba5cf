"""The three methods with their papers' settings, by name: what the examples and ``ddp.bench`` train.

* ``"diloco"``: outer SGD, lr 0.7, momentum 0.9, Nesterov (DiLoCo's), every ``period`` steps;
* ``"streaming-diloco"``: the same in ``fragments`` (default 2) fragments, each sent half a gap
  before it lands (``tau = floor(period / (2 F))``), mixed with ``alpha = 0.5`` (Streaming DiLoCo's
  choice when the delay is not zero);
* ``"desloc"``: ``(Kx, Ku, Kv) = (period, 3 period, 6 period)``, DES-LOC's recommendation; the
  optimizer must be an Adam.
"""

from __future__ import annotations

import torch

from ddp.low_communication.desloc import DESLOC
from ddp.low_communication.diloco import DiLoCo

__all__ = ["METHODS", "low_communication"]

METHODS = ("diloco", "streaming-diloco", "desloc")


def low_communication(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, period: int, *,
                      fragments: int = 2, **options):
    """``name`` (one of :data:`METHODS`) around ``optimizer``, the inner one; ``options`` go to
    the method (``warmup_steps``, ``process_group``, ``algorithm``)."""
    if name == "desloc":
        return DESLOC(model, optimizer, (period, 3 * period, 6 * period), **options)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    if name == "diloco":
        return DiLoCo(model, optimizer, outer, period, **options)
    if name != "streaming-diloco":
        raise ValueError(f"low_communication: unknown method {name!r}; expected one of {METHODS}")
    return DiLoCo(model, optimizer, outer, period, fragments, fragment_sync_delay=period // (2 * fragments),
                  fragment_update_alpha=0.5, **options)
