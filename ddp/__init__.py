"""PyTorch DistributedDataParallel on commlib (Li et al., VLDB 2020), and communication-efficient
data parallelism on top of it.

    from ddp import DistributedDataParallel as DDP
    model = DDP(net)                # under mpiexec, after commlib.init()

Submodules: :mod:`ddp.hooks` (comm hooks: PowerSGD, post-local SGD, fp16...),
:mod:`ddp.averaging` (model averagers for local SGD), :mod:`ddp.optim`
(``PostLocalSGDOptimizer``), :mod:`ddp.join` (``Join`` for uneven inputs), :mod:`ddp.low_communication`
(``DiLoCo``, Streaming DiLoCo, ``DESLOC``).
"""

from ddp import averaging, hooks, optim
from ddp.distributed import DistributedDataParallel
from ddp.fault_tolerant import (FaultTolerantDDP, FaultTolerantDiLoCo, fault_tolerant_ddp, fault_tolerant_torch_ddp,
                                manager_comm_hook)
from ddp.join import Join, Joinable, JoinHook
from ddp.low_communication import DESLOC, DiLoCo

__all__ = ["DistributedDataParallel", "FaultTolerantDDP", "FaultTolerantDiLoCo", "fault_tolerant_torch_ddp",
           "fault_tolerant_ddp", "manager_comm_hook", "Join", "Joinable", "JoinHook",
           "hooks", "averaging", "optim", "DiLoCo", "DESLOC"]
