"""The autograd internals DDP needs, in one place: grad-ready hooks, the final callback, and a
walk of the autograd graph to find parameters a backward pass will never reach.

* ``register_grad_ready_hooks`` uses ``Tensor.register_post_accumulate_grad_hook``: it fires
  after the gradient of a leaf has been accumulated into ``.grad`` (once per backward, even for a
  parameter used several times in the forward, because the engine sums the incoming gradients
  before running the leaf's single ``AccumulateGrad`` node).
* ``queue_final_callback`` runs a function once the engine finished the whole backward pass, in
  the thread that called ``backward()``; an exception it raises comes out of ``backward()``.
  It may only be called while a backward pass runs (from a hook).
* ``reachable_leaves`` walks ``grad_fn.next_functions`` from the outputs; a parameter's
  ``AccumulateGrad`` node holds it in ``.variable``.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Sequence, Set

import torch

__all__ = ["register_grad_ready_hooks", "queue_final_callback", "reachable_leaves",
           "find_unreachable", "output_tensors"]


def register_grad_ready_hooks(params: Sequence[torch.Tensor], on_ready: Callable[[int], None]) -> List:
    """Call ``on_ready(i)`` each time ``params[i].grad`` has been accumulated. Returns the handles."""
    handles = []
    for index, param in enumerate(params):
        if not param.requires_grad:
            continue
        handles.append(param.register_post_accumulate_grad_hook(_IndexedHook(index, on_ready)))
    return handles


class _IndexedHook:
    """Holds the index, not the parameter: a hook stored on a tensor must not keep that tensor alive."""

    __slots__ = ("index", "on_ready")

    def __init__(self, index: int, on_ready: Callable[[int], None]):
        self.index = index
        self.on_ready = on_ready

    def __call__(self, _param) -> None:
        self.on_ready(self.index)


def queue_final_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (call only from inside one)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def output_tensors(output) -> List[torch.Tensor]:
    """The tensors in a forward's output: a tensor, or nested lists/tuples/dicts of them."""
    found: List[torch.Tensor] = []
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dataclass_fields__"):
            stack.extend(getattr(item, name) for name in item.__dataclass_fields__)
    return found


def reachable_leaves(outputs: Iterable[torch.Tensor]) -> Set[int]:
    """``id()`` of every leaf tensor a backward from ``outputs`` would accumulate a gradient into."""
    leaves: Set[int] = set()
    seen = set()
    stack = []
    for tensor in outputs:
        if tensor.grad_fn is not None:
            stack.append(tensor.grad_fn)
        elif tensor.requires_grad:  # the output is itself a leaf
            leaves.add(id(tensor))
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad
        if variable is not None:
            leaves.add(id(variable))
        for next_node, _ in node.next_functions:
            if next_node is not None and next_node not in seen:
                stack.append(next_node)
    return leaves


def find_unreachable(outputs, params: Sequence[torch.Tensor]) -> List[int]:
    """Indices of the ``params`` (that require grad) no backward from ``outputs`` will reach."""
    leaves = reachable_leaves(output_tensors(outputs))
    return [i for i, p in enumerate(params) if p.requires_grad and id(p) not in leaves]
