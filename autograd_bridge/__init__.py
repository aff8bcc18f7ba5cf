"""The bridge between torch and commlib: zero-copy tensor views, autograd hooks
(:mod:`.autograd_hooks`: grad-ready hooks, the final callback, the graph walk), a
``torch.distributed`` backend named "commlib", and differentiable collectives.

Importing this package registers the backend name "commlib" with ``torch.distributed``.
"""

from . import functional
from .backend import BACKEND_NAME, CommlibProcessGroup, commlib_group_of
from .backend import register as _register_backend
from .cuda_streams import on_torch_stream
from .rendezvous import init_process_group
from .tensors import from_array, is_cuda, to_array

_register_backend()

__all__ = ["to_array", "from_array", "is_cuda", "init_process_group", "CommlibProcessGroup",
           "commlib_group_of", "BACKEND_NAME", "functional", "on_torch_stream"]
