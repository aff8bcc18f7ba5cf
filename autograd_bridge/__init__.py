"""The bridge between torch and commlib: zero-copy tensor views, autograd hooks, a
``torch.distributed`` backend named "commlib", and differentiable collectives.

Importing this package registers the backend name "commlib" with ``torch.distributed``.
"""

from . import functional
from .backend import BACKEND_NAME, CommlibProcessGroup, commlib_group_of, init_process_group
from .backend import register as _register_backend
from .tensors import from_array, is_cuda, to_array

_register_backend()

__all__ = ["to_array", "from_array", "is_cuda", "init_process_group", "CommlibProcessGroup",
           "commlib_group_of", "BACKEND_NAME", "functional"]
