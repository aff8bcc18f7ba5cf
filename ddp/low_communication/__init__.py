"""Low-communication training with adaptive optimizers: DiLoCo, Streaming DiLoCo, DES-LOC.

* :class:`DiLoCo` (:mod:`.diloco`): inner steps of any optimizer, every ``sync_every`` steps the
  averaged pseudo-gradient stepped by an outer optimizer; with ``fragments``,
  ``fragment_sync_delay``, ``fragment_update_alpha`` and ``outer_dtype``, Streaming DiLoCo;
* :class:`DESLOC` (:mod:`.desloc`): local Adam whose parameters and two moments are averaged on
  periods of their own;
* :func:`low_communication` (:mod:`.presets`): one of them by name with its paper's settings;
* :mod:`.fragments`: the fragments and their schedule, pure functions;
* :mod:`.base`: what both share (the optimizer hooks, the warm-up, DDP, Join, bytes).

Both are context managers around an unchanged training loop, checkpointable, Join-aware, and count
their bytes (``bytes_sent``).
"""

from ddp.low_communication.desloc import DESLOC
from ddp.low_communication.diloco import DiLoCo
from ddp.low_communication.fragments import fragment_offsets, split_parameters
from ddp.low_communication.presets import METHODS, low_communication

__all__ = ["DiLoCo", "DESLOC", "low_communication", "METHODS", "fragment_offsets", "split_parameters"]
