"""PyTorch DistributedDataParallel on commlib (Li et al., VLDB 2020), and communication-efficient
data parallelism on top of it.

    from ddp import DistributedDataParallel as DDP
    model = DDP(net)                # under mpiexec, after commlib.init()

Submodules: :mod:`ddp.hooks` (comm hooks: PowerSGD, post-local SGD, fp16...),
:mod:`ddp.averaging` (model averagers for local SGD), :mod:`ddp.optim`
(``PostLocalSGDOptimizer``), :mod:`ddp.join` (``Join`` for uneven inputs).
"""

from . import averaging, hooks, optim
from .distributed import DistributedDataParallel
from .join import Join, Joinable, JoinHook

__all__ = ["DistributedDataParallel", "Join", "Joinable", "JoinHook", "hooks", "averaging", "optim"]
