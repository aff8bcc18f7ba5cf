"""Communication hooks: how one bucket of gradients is reduced (torch's names).

* :mod:`.default`: ``GradBucket``, what a hook is and returns (``CommHook``, ``HookResult``:
  a :class:`commlib.WorkHandle` or a ``torch.futures.Future``), the default average, fp16/bf16
  compression;
* :mod:`.powersgd`: ``PowerSGDState``, ``powerSGD_hook``, ``batched_powerSGD_hook``;
* :mod:`.post_localsgd`: ``PostLocalSGDState``, ``post_localSGD_hook``.
"""

from ddp.hooks.default import (CommHook, CompletedWork, GradBucket, HookResult, HookWork, allreduce_hook,
                               bf16_compress_hook, fp16_compress_hook)
from ddp.hooks.post_localsgd import PostLocalSGDState, post_localSGD_hook
from ddp.hooks.powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = ["GradBucket", "HookWork", "CompletedWork", "HookResult", "CommHook", "allreduce_hook", "fp16_compress_hook",
           "bf16_compress_hook", "PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook",
           "PostLocalSGDState", "post_localSGD_hook"]
