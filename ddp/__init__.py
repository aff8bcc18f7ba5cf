"""PyTorch DistributedDataParallel on commlib (Li et al., VLDB 2020).

    from ddp import DistributedDataParallel as DDP
    model = DDP(net)                # under mpiexec, after commlib.init()
"""

from .distributed import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
