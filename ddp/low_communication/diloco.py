"""``DiLoCo`` (Douillard et al., arXiv 2311.08105) and Streaming DiLoCo (arXiv 2501.18512).

    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    with ddp.DiLoCo(model, inner, outer, sync_every=50):
        ...; loss.backward(); inner.step()

Terms. The *global* parameters ``theta`` are the same on every rank; between synchronisations each
rank trains its *local* copy with the inner optimizer (AdamW in the paper; its state stays local).
A synchronisation of a *fragment* (a set of whole parameters; the whole model by default):

    delta_r  = theta - local_r                       the pseudo-gradient of rank r
    delta    = sum_r (delta_r / P)                   one allreduce, in ``outer_dtype`` if given
    theta'   = outer optimizer step on theta with gradient delta
    local_r <- theta' + alpha (local_r - theta')     ``fragment_update_alpha``; 0: every rank theta'

With one fragment and no delay this happens right after inner step ``t`` when ``t % H == 0``
(``sync_every=H``). Streaming DiLoCo (``fragments``: a count, or a list of modules) lands one
fragment every ``H / F`` steps, and sends fragment ``i``'s ``delta`` ``tau``
(``fragment_sync_delay``) steps before it lands: the allreduce runs on the group's communication
thread while the next ``tau`` inner steps compute, and ``local_r`` in the last line is the local
fragment after those steps (the schedule: :mod:`ddp.low_communication.fragments`).

Cost. Per round of ``H`` steps every parameter crosses once: ``bytes_sent`` grows by
``numel x element size`` of the wire dtype per fragment launch, ``N s / H`` per step on average
against DDP's ``N s``; fragments make the peak ``F`` times smaller, not the total.

The outer optimizer is any torch optimizer over the model's parameters (one for all fragments or
a list, one per fragment, as torchft's); its step sees only the landing fragment's gradients (the
others' ``.grad`` are set aside and put back, so the loop's gradients are untouched). The global
parameters and the outer optimizer's state are in :meth:`state_dict`, with a fragment in flight
(waited for: a resumed run lands the same bits); the model and the inner optimizer are the
user's to checkpoint. Warm-up, DDP, Join and bytes: :mod:`ddp.low_communication.base`.
"""

from __future__ import annotations

import numbers
from typing import Dict, List, Optional, Sequence, Union

import torch

from ddp.join import Join
from ddp.low_communication.base import LowCommunication
from ddp.low_communication.exchange import (Averaging, Workspace, flatten, flatten_into, group_by_dtype,
                                            start_averaging, unflatten_into)
from ddp.low_communication.fragments import check_delay, fragment_offsets, split_parameters

__all__ = ["DiLoCo"]

WIRE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Fragment:
    """Parameters synchronised together: by dtype (one flat buffer each), their global values."""

    __slots__ = ("index", "params", "groups", "offset", "outer", "global_flats")

    def __init__(self, index: int, params: List[torch.Tensor], offset: int, outer: torch.optim.Optimizer):
        self.index = index
        self.params = params
        self.groups = [[params[i] for i in indices] for indices in group_by_dtype(params)]
        self.offset = offset
        self.outer = outer
        self.global_flats: Optional[List[torch.Tensor]] = None

    def locals(self) -> List[torch.Tensor]:
        return [flatten(group) for group in self.groups]

    def buffers(self, workspace: Workspace, what: str) -> List[torch.Tensor]:
        """One kept flat buffer per dtype group, named ``what``."""
        return [workspace.get((self.index, what, g), sum(p.numel() for p in group), group[0].dtype, group[0].device)
                for g, group in enumerate(self.groups)]

    @property
    def numels(self) -> List[int]:
        return [p.numel() for p in self.params]


class DiLoCo(LowCommunication):
    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer]], sync_every: int,
                 fragments: Union[int, Sequence[torch.nn.Module], None] = None, fragment_sync_delay: int = 0,
                 fragment_update_alpha: float = 0.0, outer_dtype: Optional[torch.dtype] = None, *,
                 warmup_steps: int = 0, process_group=None, algorithm: str = "auto"):
        params: List[torch.Tensor] = [p for p in model.parameters() if p.requires_grad]
        super().__init__(model, inner_optimizer, params, warmup_steps=warmup_steps, process_group=process_group,
                         algorithm=algorithm)
        parts = self._fragment_params(fragments)
        self.sync_every = sync_every
        offsets = fragment_offsets(sync_every, len(parts))
        self.fragment_sync_delay = check_delay(fragment_sync_delay, offsets)
        alpha: object = fragment_update_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"DiLoCo: fragment_update_alpha must be a number in [0, 1], got {alpha!r}")
        self.fragment_update_alpha = float(fragment_update_alpha)
        if outer_dtype is not None and outer_dtype not in WIRE_DTYPES:
            raise ValueError(f"DiLoCo: outer_dtype must be None or one of {WIRE_DTYPES}, got {outer_dtype!r}")
        self.outer_dtype = outer_dtype
        outers = self._outer_optimizers(outer_optimizer, parts, inner_optimizer)
        self.outer_optimizers = outers
        self.fragments = [Fragment(i, part, offset, outer) for i, (part, offset, outer)
                          in enumerate(zip(parts, offsets, outers))]
        self._in_flight: Optional[tuple] = None  # (fragment index, Averaging)
        self._workspace = Workspace()

    # -- arguments -----------------------------------------------------------------------------
    def _fragment_params(self, fragments) -> List[List[torch.Tensor]]:
        params = self.params
        if fragments is None:
            return [list(params)]
        if isinstance(fragments, int) and not isinstance(fragments, bool):
            return [[params[i] for i in part] for part in split_parameters([p.numel() for p in params], fragments)]
        if isinstance(fragments, torch.nn.Module) or not all(isinstance(f, torch.nn.Module) for f in fragments):
            raise TypeError(f"DiLoCo: fragments must be None, a count, or a list of modules, got {fragments!r}")
        owner: Dict[int, int] = {}
        parts: List[List[torch.Tensor]] = []
        for index, module in enumerate(fragments):
            part = [p for p in module.parameters() if p.requires_grad]
            if not part:
                raise ValueError(f"DiLoCo: fragment {index} ({type(module).__name__}) has no trainable parameter")
            for p in part:
                if id(p) in owner:
                    raise ValueError(f"DiLoCo: a parameter of shape {tuple(p.shape)} is in fragments {owner[id(p)]} "
                                     f"and {index}; fragments must not overlap")
                owner[id(p)] = index
            parts.append(part)
        missing = [tuple(p.shape) for p in params if id(p) not in owner]
        foreign = len(owner) - (len(params) - len(missing))
        if missing or foreign:
            raise ValueError(f"DiLoCo: the fragments must hold exactly the model's trainable parameters: "
                             f"{len(missing)} of the model's are in no fragment (shapes {missing[:4]}), "
                             f"{foreign} in a fragment are not the model's")
        # Within a fragment, the model's order: the same on every rank whatever the modules' order.
        position = {id(p): i for i, p in enumerate(params)}
        return [sorted(part, key=lambda p: position[id(p)]) for part in parts]

    @staticmethod
    def _outer_optimizers(outer, parts, inner) -> List[torch.optim.Optimizer]:
        outers = list(outer) if isinstance(outer, (list, tuple)) else [outer] * len(parts)
        if len(outers) != len(parts):
            raise ValueError(f"DiLoCo: {len(outers)} outer optimizers for {len(parts)} fragments; give one, or one "
                             f"per fragment")
        for index, (optimizer, part) in enumerate(zip(outers, parts)):
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"DiLoCo: the outer optimizer must be a torch.optim.Optimizer, got "
                                f"{type(optimizer).__name__}")
            if optimizer is inner:
                raise ValueError("DiLoCo: the outer optimizer is the inner one; build a separate one (e.g. "
                                 "torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True))")
            owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
            strays = [tuple(p.shape) for p in part if id(p) not in owned]
            if strays:
                raise ValueError(f"DiLoCo: the outer optimizer of fragment {index} does not hold {len(strays)} of its "
                                 f"parameters (shapes {strays[:4]}); build it over the model's parameters")
        return outers

    # -- the schedule --------------------------------------------------------------------------
    def _start(self) -> None:
        for fragment in self.fragments:
            fragment.global_flats = fragment.locals()

    def _position(self, t: int) -> int:
        """Where step t is in its round: 1..H."""
        return (t - 1) % self.sync_every + 1

    @property
    def in_flight(self) -> Optional[int]:
        """The fragment whose synchronisation is on its way, or None."""
        return None if self._in_flight is None else self._in_flight[0]

    def _on_step(self, join: Optional[Join], contribute: bool) -> None:
        t = self.step - self.warmup_steps
        if t < 1:
            return
        position = self._position(t)
        for fragment in self.fragments:
            if fragment.offset - self.fragment_sync_delay == position:
                self._launch(fragment, join, contribute)
        if self._in_flight is not None and self.fragments[self._in_flight[0]].offset == position:
            self._land()

    def _launch(self, fragment: Fragment, join: Optional[Join], contribute: bool) -> None:
        assert self._in_flight is None and fragment.global_flats is not None  # by check_delay; started
        deltas = fragment.buffers(self._workspace, "delta")
        with torch.no_grad():
            for group, theta, delta in zip(fragment.groups, fragment.global_flats, deltas):
                offset = 0
                for param in group:  # theta - local, parameter by parameter: no flat copy of the locals
                    end = offset + param.numel()
                    torch.sub(theta[offset:end], param.detach().reshape(-1), out=delta[offset:end])
                    offset = end
        averaging = start_averaging(deltas, self.process_group, divisor=self.divisor(join), contribute=contribute,
                                    counter=self.sent, wire_dtype=self.outer_dtype, algorithm=self.algorithm,
                                    workspace=self._workspace, key=(fragment.index, "wire"))
        self._in_flight = (fragment.index, averaging)

    @torch.no_grad()
    def _land(self) -> None:
        assert self._in_flight is not None
        index, averaging = self._in_flight
        fragment = self.fragments[index]
        with self.waiting():
            deltas = averaging.wait()
        locals_ = None
        if self.fragment_update_alpha:
            locals_ = [flatten_into(group, local) for group, local
                       in zip(fragment.groups, fragment.buffers(self._workspace, "local"))]
        assert fragment.global_flats is not None
        for group, theta in zip(fragment.groups, fragment.global_flats):
            unflatten_into(group, theta)
        self._outer_step(fragment, deltas)
        for group, theta in zip(fragment.groups, fragment.global_flats):
            flatten_into(group, theta)
        if locals_ is not None:
            for group, local in zip(fragment.groups, locals_):
                offset = 0
                for param in group:
                    param.lerp_(local[offset:offset + param.numel()].view_as(param), self.fragment_update_alpha)
                    offset += param.numel()
        self._in_flight = None

    @staticmethod
    def _outer_step(fragment: Fragment, deltas: List[torch.Tensor]) -> None:
        """The outer optimizer's step with the fragment's averaged deltas as gradients, and only them."""
        outer = fragment.outer
        everything = [p for group in outer.param_groups for p in group["params"]]
        set_aside = [p.grad for p in everything]
        try:
            for p in everything:
                p.grad = None
            for group, delta in zip(fragment.groups, deltas):
                offset = 0
                for param in group:
                    param.grad = delta[offset:offset + param.numel()].view_as(param)
                    offset += param.numel()
            outer.step()
        finally:
            for p, grad in zip(everything, set_aside):
                p.grad = grad

    def finish(self) -> None:
        if self._in_flight is not None:
            with self.waiting():
                self._in_flight[1].wait()

    # -- checkpoints ---------------------------------------------------------------------------
    def _config(self) -> dict:
        return {"sync_every": self.sync_every, "fragments": [f.numels for f in self.fragments],
                "fragment_sync_delay": self.fragment_sync_delay, "fragment_update_alpha": self.fragment_update_alpha,
                "outer_dtype": None if self.outer_dtype is None else str(self.outer_dtype)}

    def _distinct_outers(self) -> List[torch.optim.Optimizer]:
        distinct: List[torch.optim.Optimizer] = []
        for optimizer in self.outer_optimizers:
            if all(optimizer is not seen for seen in distinct):
                distinct.append(optimizer)
        return distinct

    def state_dict(self) -> dict:
        """The step, the global parameters, the outer optimizers' states, a fragment in flight."""
        state = super().state_dict()
        state.update(self._config())
        state["global"] = [None if f.global_flats is None else [t.clone() for t in f.global_flats]
                           for f in self.fragments]
        state["outer_optimizers"] = [optimizer.state_dict() for optimizer in self._distinct_outers()]
        state["in_flight"] = None
        if self._in_flight is not None:
            state["in_flight"] = {"fragment": self._in_flight[0], "averaging": self._in_flight[1].state_dict()}
        return state

    def load_state_dict(self, state: dict) -> None:
        mine = self._config()
        theirs = {key: state.get(key) for key in mine}
        if theirs != mine:
            raise ValueError(f"DiLoCo.load_state_dict: the checkpoint was made with {theirs}, this DiLoCo has {mine}")
        self.finish()
        super().load_state_dict(state)
        for fragment, flats in zip(self.fragments, state["global"]):
            fragment.global_flats = None if flats is None else [t.clone() for t in flats]
        for optimizer, saved in zip(self._distinct_outers(), state["outer_optimizers"]):
            optimizer.load_state_dict(saved)
        saved_flight = state["in_flight"]
        self._in_flight = None if saved_flight is None else (
            saved_flight["fragment"], Averaging.from_state_dict(saved_flight["averaging"]))
