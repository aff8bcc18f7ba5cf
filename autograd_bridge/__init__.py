"""The bridge between torch and commlib: zero-copy tensor views, autograd hooks
(:mod:`.autograd_hooks`: grad-ready hooks, the final callback, the graph walk), a
``torch.distributed`` backend named "commlib" (:mod:`.backend`: torch's DDP, DeviceMesh,
DTensor, FSDP2, distributed checkpoint and ZeroRedundancyOptimizer run on it unchanged), and
differentiable collectives.

Importing this package registers the backend name "commlib" with ``torch.distributed``.
"""

from autograd_bridge import functional
from autograd_bridge.backend.process_group import BACKEND_NAME, CommlibProcessGroup, commlib_group_of
from autograd_bridge.backend.rendezvous import init_process_group
from autograd_bridge.backend.rendezvous import register as _register_backend
from autograd_bridge.cuda_streams import on_torch_stream
from autograd_bridge.tensors import from_array, is_cuda, to_array

_register_backend()

__all__ = ["to_array", "from_array", "is_cuda", "init_process_group", "CommlibProcessGroup",
           "commlib_group_of", "BACKEND_NAME", "functional", "on_torch_stream"]
