"""Communication hooks: how one bucket of gradients is reduced (torch's names).

* :mod:`.default`: ``GradBucket``, the default average, fp16/bf16 compression;
* :mod:`.powersgd`: ``PowerSGDState``, ``powerSGD_hook``, ``batched_powerSGD_hook``;
* :mod:`.post_localsgd`: ``PostLocalSGDState``, ``post_localSGD_hook``.
"""

from .default import (CompletedWork, GradBucket, HookWork, allreduce_hook, bf16_compress_hook,
                      fp16_compress_hook)
from .post_localsgd import PostLocalSGDState, post_localSGD_hook
from .powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = ["GradBucket", "HookWork", "CompletedWork", "allreduce_hook", "fp16_compress_hook",
           "bf16_compress_hook", "PowerSGDState", "powerSGD_hook", "batched_powerSGD_hook",
           "PostLocalSGDState", "post_localSGD_hook"]
