"""The allreduce algorithm registry: adding an algorithm is adding a file and a line.

An allreduce algorithm is a function ``fn(transport, buf, op, *, segment_bytes) -> None`` that
reduces the flat 1-D array ``buf`` in place across ``transport.size`` ranks with the element-wise
``op`` (``ReduceOp.AVG`` never reaches it: the group divides after a SUM). It must work for every
world size 1..N, any ``buf.size`` (0 and sizes below the world size included), and leave the same
bytes on every rank. It talks only to the :class:`commlib.transport.Transport` it is given.

Register one from anywhere (a research script, a plugin)::

    from commlib.algorithms import register_algorithm
    register_algorithm("my_allreduce", my_allreduce)
"""

from __future__ import annotations

from typing import Callable, Dict, List

from ..errors import InvalidUsageError

__all__ = ["register_algorithm", "get_algorithm", "algorithm_names", "AllreduceFn"]

AllreduceFn = Callable[..., None]
_REGISTRY: Dict[str, AllreduceFn] = {}
RESERVED_NAMES = ("auto",)


def register_algorithm(name: str, fn: AllreduceFn, *, replace: bool = False) -> AllreduceFn:
    if not isinstance(name, str) or not name.isidentifier():
        raise InvalidUsageError(f"algorithm name {name!r}: expected a Python identifier")
    if name in RESERVED_NAMES:
        raise InvalidUsageError(f"algorithm name {name!r} is reserved")
    if not callable(fn):
        raise InvalidUsageError(f"algorithm {name!r}: expected a callable, got {type(fn).__name__}")
    if name in _REGISTRY and not replace and _REGISTRY[name] is not fn:
        raise InvalidUsageError(f"algorithm {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = fn
    return fn


def get_algorithm(name: str) -> AllreduceFn:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise InvalidUsageError(
            f"unknown allreduce algorithm {name!r}: expected one of "
            f"{', '.join(['auto'] + algorithm_names())}"
        ) from None


def algorithm_names() -> List[str]:
    return sorted(_REGISTRY)


def _register_builtins() -> None:
    from . import native

    register_algorithm("native", native.allreduce_native)
    # The schedules below are written against the transport interface only.
    for module_name, fn_name, name in (
        ("ring", "allreduce_ring", "ring"),
        ("tree", "allreduce_tree", "tree"),
        ("recursive_doubling", "allreduce_recursive_doubling", "recursive_doubling"),
        ("rabenseifner", "allreduce_rabenseifner", "rabenseifner"),
        ("hierarchical", "allreduce_hierarchical", "hierarchical"),
    ):
        try:
            module = __import__(f"{__name__}.{module_name}", fromlist=[fn_name])
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{module_name}":
                raise
            continue
        register_algorithm(name, getattr(module, fn_name))


_register_builtins()
