"""commlib as a ``torch.distributed`` backend named ``"commlib"``."""

from autograd_bridge.backend.process_group import BACKEND_NAME, CommlibProcessGroup, commlib_group_of
from autograd_bridge.backend.rendezvous import init_process_group, register

__all__ = ["BACKEND_NAME", "CommlibProcessGroup", "commlib_group_of", "register", "init_process_group"]
