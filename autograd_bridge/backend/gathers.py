"""The "commlib" torch backend's gathers and scatters, mixed into :class:`.CommlibProcessGroup`.

What torch calls, and what runs (each a commlib collective, its algorithm chosen by "auto"):

* ``allgather`` (list outputs), ``all_gather_single`` / ``_allgather_base``
  (``dist.all_gather_into_tensor``: FSDP2's parameter all-gather, DTensor's Shard -> Replicate):
  ``allgather``. In place, as FSDP2 calls it (the input is this rank's block of the output), the
  input is copied first: commlib's buffers may not overlap.
* ``reduce_scatter`` (list inputs), ``reduce_scatter_single`` / ``_reduce_scatter_base``
  (``dist.reduce_scatter_tensor``: FSDP2's gradient reduce-scatter, with AVG, SUM or PREMUL_SUM):
  ``reduce_scatter``.
* the coalesced forms (``allgather_into_tensor_coalesced``, ``reduce_scatter_tensor_coalesced``,
  ``allgather_coalesced``; what DTensor and torch's functional collectives batch): one commlib
  collective over the tensors packed side by side when they share a dtype and are small
  (:data:`PACK_BYTES`, where one call's latency is worth a copy), else one per tensor. Issue order
  is completion order, so the last Work stands for all.
* ``gather`` / ``scatter`` (and the ``*_object`` collectives riding on them): commlib's rooted
  ones, so each rank moves its block once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, List

import torch

import commlib
from commlib import InvalidUsageError

from autograd_bridge.backend.profiling import profiled, tensors_of
from autograd_bridge.backend.reduce_ops import Reduction, plan_reduction
from autograd_bridge.backend.staging import Staged, copy_back_all, single
from autograd_bridge.backend.validation import check_served

if TYPE_CHECKING:
    from autograd_bridge.backend.work import Completer

__all__ = ["GatherMethods", "PACK_BYTES", "overlap"]

PACK_BYTES = 256 << 10


class GatherMethods:
    # Provided by CommlibProcessGroup, which mixes this in.
    commlib_group: commlib.ProcessGroup
    _completer: Completer
    size: Callable[[], int]
    rank: Callable[[], int]
    _done: object

    # -- allgather ------------------------------------------------------------------------------
    @profiled("all_gather", lambda outputs, inputs, opts=None: tensors_of(inputs))
    def allgather(self, output_lists, input_tensors, opts=None):
        outputs = single(output_lists, "allgather") if not isinstance(output_lists[0], torch.Tensor) else output_lists
        tensor = single(input_tensors, "allgather")
        check_served("all_gather", tensor, "input")
        self._check_parts(outputs, tensor, "allgather", "output list")
        flat = torch.empty((self.size(),) + tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device)
        inp, flat_staged = Staged(tensor, "allgather input"), Staged(flat, "allgather staging")
        group = self.commlib_group

        def finish():
            for index, out in enumerate(outputs):
                out.copy_(flat[index])

        return self._completer.complete(
            opts, lambda async_op: group.allgather(flat_staged.array, inp.array, async_op=async_op),
            [outputs], finish, inp.cuda_device, nbytes=flat_staged.array.nbytes)

    @profiled("all_gather_into_tensor", lambda output, input, opts=None: [input])
    def all_gather_single(self, output, input, opts=None):
        for tensor, what in ((output, "output"), (input, "input")):
            check_served("all_gather_into_tensor", tensor, what)
        if overlap(output, input):  # FSDP2 gathers in place: its shard is a block of the output
            input = input.clone()
        out, inp = Staged(output, "all_gather output"), Staged(input, "all_gather input")
        group = self.commlib_group
        return self._completer.complete(
            opts, lambda async_op: group.allgather(out.array, inp.array, async_op=async_op),
            [output], copy_back_all([out]), out.cuda_device, nbytes=out.array.nbytes)

    _allgather_base = all_gather_single

    @profiled("all_gather_coalesced", lambda outputs, inputs, opts=None: tensors_of(inputs))
    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        # As torch's all_gather_coalesced: output_lists[r][i] receives rank r's input i.
        if len(output_lists) != self.size():
            raise InvalidUsageError(f"commlib backend: allgather_coalesced: {len(output_lists)} output lists; "
                                    f"expected world size {self.size()} (one list per rank)")
        for rank, outs in enumerate(output_lists):
            if len(outs) != len(input_tensors):
                raise InvalidUsageError(f"commlib backend: allgather_coalesced: output list {rank} has {len(outs)} "
                                        f"tensors; expected {len(input_tensors)}, one per input tensor")
        for index, inp in enumerate(input_tensors):
            self._check_parts([outs[index] for outs in output_lists], inp, "allgather_coalesced",
                              f"the outputs of input {index}")
        works = [self.allgather([outs[index] for outs in output_lists], [inp], opts)
                 for index, inp in enumerate(input_tensors)]
        return works[-1] if works else self._done

    @profiled("all_gather_into_tensor_coalesced", lambda outputs, inputs, opts=None: tensors_of(inputs))
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        if _packable(inputs, outputs, sum(t.numel() * t.element_size() for t in outputs)):
            self._check_blocks(outputs, inputs, "allgather_into_tensor_coalesced", "output", "input")
            packed_in = torch.cat([t.reshape(-1) for t in inputs])
            packed_out = torch.empty(self.size() * packed_in.numel(), dtype=packed_in.dtype)

            def unpack():
                rows = packed_out.view(self.size(), -1)
                offset = 0
                for out, inp in zip(outputs, inputs):
                    out.view(self.size(), -1).copy_(rows[:, offset:offset + inp.numel()])
                    offset += inp.numel()

            return self._packed(packed_out, packed_in, outputs, unpack, opts,
                                lambda out, inp, async_op: self.commlib_group.allgather(out, inp, async_op=async_op))
        works = [self.all_gather_single(out, inp, opts) for out, inp in zip(outputs, inputs)]
        return works[-1] if works else self._done

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    # -- reduce_scatter -------------------------------------------------------------------------
    @profiled("reduce_scatter", lambda outputs, inputs, opts=None: tensors_of(inputs))
    def reduce_scatter(self, outputs, input_lists, opts=None):
        output = single(outputs, "reduce_scatter")
        parts = single(input_lists, "reduce_scatter") if not isinstance(input_lists[0], torch.Tensor) else input_lists
        check_served("reduce_scatter", output, "output")
        self._check_parts(parts, output, "reduce_scatter", "input list")
        return self.reduce_scatter_single(output, torch.stack([p.detach() for p in parts]), opts)

    @profiled("reduce_scatter_tensor", lambda output, input, opts=None: [input])
    def reduce_scatter_single(self, output, input, opts=None):
        for tensor, what in ((output, "output"), (input, "input")):
            check_served("reduce_scatter_tensor", tensor, what)
        plan = plan_reduction("reduce_scatter_tensor", None if opts is None else opts.reduceOp, [output, input])
        input = _reduce_scatter_input(plan, "reduce_scatter_tensor", input, output)
        out, inp = (Staged(output, "reduce_scatter output", reduces=True),
                    Staged(input, "reduce_scatter input", reduces=True))
        op, group = plan.op, self.commlib_group
        return self._completer.complete(
            opts, lambda async_op: group.reduce_scatter(out.array, inp.array, op, async_op=async_op),
            [output], copy_back_all([out]), out.cuda_device, nbytes=inp.array.nbytes)

    _reduce_scatter_base = reduce_scatter_single

    @profiled("reduce_scatter_tensor_coalesced", lambda outputs, inputs, opts=None: tensors_of(inputs))
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        if _packable(outputs, inputs, sum(t.numel() * t.element_size() for t in inputs)):
            self._check_blocks(inputs, outputs, "reduce_scatter_tensor_coalesced", "input", "output")
            op = None if opts is None else opts.reduceOp
            plan = plan_reduction("reduce_scatter_tensor_coalesced", op, list(outputs) + list(inputs))
            size = self.size()
            # Rank r's block of the packed input is every input's block r, side by side.
            packed_in = torch.cat([t.reshape(size, -1) for t in inputs], dim=1).reshape(-1)
            packed_in = _reduce_scatter_input(plan, "reduce_scatter_tensor_coalesced", packed_in, None)
            packed_out = torch.empty(packed_in.numel() // size, dtype=packed_in.dtype)

            def unpack():
                offset = 0
                for out in outputs:
                    out.view(-1).copy_(packed_out[offset:offset + out.numel()])
                    offset += out.numel()

            return self._packed(packed_out, packed_in, outputs, unpack, opts,
                                lambda out, inp, async_op: self.commlib_group.reduce_scatter(
                                    out, inp, plan.op, async_op=async_op), reduces=True)
        works = [self.reduce_scatter_single(out, inp, opts) for out, inp in zip(outputs, inputs)]
        return works[-1] if works else self._done

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _packed(self, packed_out, packed_in, outputs, unpack, opts, run, reduces: bool = False):
        out = Staged(packed_out, "coalesced output", reduces=reduces)
        inp = Staged(packed_in, "coalesced input", reduces=reduces)
        copy_back = copy_back_all([out])

        def finish():
            if copy_back is not None:
                copy_back()
            unpack()

        return self._completer.complete(opts, lambda async_op: run(out.array, inp.array, async_op),
                                        list(outputs), finish, nbytes=max(out.array.nbytes, inp.array.nbytes))

    # -- rooted ---------------------------------------------------------------------------------
    @profiled("gather", lambda outputs, inputs, opts=None: tensors_of(inputs))
    def gather(self, output_lists, input_tensors, opts=None):
        root = 0 if opts is None else opts.rootRank
        tensor = single(input_tensors, "gather")
        check_served("gather", tensor, "input")
        inp = Staged(tensor, "gather input")  # non-contiguous: a copy, never copied back
        outputs = output_lists[0] if output_lists else []
        flat_staged = None
        if self.rank() == root:
            self._check_parts(outputs, inp.tensor, "gather", "gather_list")
            flat_staged = Staged(torch.empty((self.size(),) + tuple(inp.tensor.shape), dtype=inp.tensor.dtype,
                                             device=inp.tensor.device), "gather staging")
        flat_out = None if flat_staged is None else flat_staged.array
        group = self.commlib_group

        def finish():
            if flat_staged is not None:
                for index, out in enumerate(outputs):
                    out.copy_(flat_staged.tensor[index])

        # The future's value is what gloo's holds: the gather list on the root, [] elsewhere.
        return self._completer.complete(
            opts, lambda async_op: group.gather(flat_out, inp.array, root, async_op=async_op),
            list(outputs), finish, inp.cuda_device, nbytes=inp.array.nbytes * self.size())

    @profiled("scatter", lambda outputs, inputs, opts=None: tensors_of(outputs))
    def scatter(self, output_tensors, input_lists, opts=None):
        root = 0 if opts is None else opts.rootRank
        tensor = single(output_tensors, "scatter")
        check_served("scatter", tensor, "output")
        out = Staged(tensor, "scatter output")
        flat_in = None
        if self.rank() == root:
            parts = input_lists[0] if input_lists else []
            self._check_parts(parts, out.tensor, "scatter", "scatter_list")
            flat_in = Staged(torch.stack([p.detach() for p in parts]), "scatter staging").array
        group = self.commlib_group
        return self._completer.complete(
            opts, lambda async_op: group.scatter(out.array, flat_in, root, async_op=async_op),
            [out.tensor], copy_back_all([out]), out.cuda_device, nbytes=out.array.nbytes * self.size())

    def _check_blocks(self, big, small, collective: str, big_name: str, small_name: str) -> None:
        if len(big) != len(small):
            raise InvalidUsageError(f"commlib backend: {collective}: {len(big)} {big_name}s and {len(small)} "
                                    f"{small_name}s; expected one {big_name} per {small_name}")
        for index, (b, s) in enumerate(zip(big, small)):
            if b.numel() != self.size() * s.numel():
                raise InvalidUsageError(
                    f"commlib backend: {collective}: {big_name} {index} has {b.numel()} elements; expected "
                    f"world size {self.size()} x {small_name} {index}'s {s.numel()}")

    def _check_parts(self, parts, like: torch.Tensor, collective: str, what: str) -> None:
        if len(parts) != self.size():
            raise InvalidUsageError(f"commlib backend: {collective}: {what} has {len(parts)} tensors; "
                                    f"expected world size {self.size()}")
        for index, part in enumerate(parts):
            if part.shape != like.shape or part.dtype != like.dtype:
                raise InvalidUsageError(
                    f"commlib backend: {collective}: {what}[{index}] is {part.dtype} {tuple(part.shape)}; "
                    f"expected {like.dtype} {tuple(like.shape)} like this rank's tensor"
                )


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory ranges intersect."""
    if a.device != b.device or not a.numel() or not b.numel():
        return False
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b.numel() * b.element_size() and b_start < a_start + a.numel() * a.element_size()


def _packable(tensors: List[torch.Tensor], others: List[torch.Tensor], nbytes: int) -> bool:
    """Several small CPU tensors of one dtype: worth one collective over a packed copy."""
    everything = list(tensors) + list(others)
    if len(tensors) < 2 or nbytes > PACK_BYTES:
        return False
    for tensor in everything:
        check_served("coalesced collective", tensor)
    first = everything[0]
    return all(t.dtype == first.dtype and t.device.type == "cpu" for t in everything)


def _reduce_scatter_input(plan: Reduction, collective: str, input: torch.Tensor, output) -> torch.Tensor:
    """The input as sent: scaled for PREMUL_SUM (never in the caller's tensor), copied where the
    output lies inside it (commlib's buffers may not overlap)."""
    if plan.bitwise is not None:
        raise InvalidUsageError(f"commlib backend: {collective} with a bitwise op (BAND, BOR, BXOR) on a "
                                f"{input.dtype} tensor on {input.device} is not supported; expected SUM, AVG, "
                                f"MIN, MAX, PRODUCT or PREMUL_SUM")
    if plan.premul is not None:
        return input * plan.premul
    if output is not None and overlap(output, input):
        return input.clone()
    return input
