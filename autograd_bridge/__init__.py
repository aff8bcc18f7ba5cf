"""The bridge between torch and commlib: zero-copy tensor views, autograd hooks, a
``torch.distributed`` backend named "commlib", and differentiable collectives."""

from .tensors import from_array, is_cuda, to_array

__all__ = ["to_array", "from_array", "is_cuda"]
