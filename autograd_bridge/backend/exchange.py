"""The "commlib" torch backend's point-to-point, all-to-all and monitored barrier.

Mixed into :class:`.backend.CommlibProcessGroup`. What torch calls, and what runs:

* ``send`` / ``recv`` / ``recv_anysource`` (``dist.send``, ``dist.recv``, ``dist.isend``,
  ``dist.irecv``, and ``dist.batch_isend_irecv``, which calls those one by one for a backend
  without coalescing): commlib's ``isend``/``irecv`` on the group's point-to-point communicator,
  so they never mix with collectives and take no collective sequence number. The returned Work
  waits on commlib's work directly and names the sender (``_source_rank``); its future (made on
  first ``get_future()``) is completed by the group's point-to-point progress thread when the
  message completed, outside the order of collectives: a future callback there must not wait
  for another point-to-point message (the thread that would complete it is the one waiting).
* ``alltoall`` (``dist.all_to_all``, a list of tensors per peer, sizes may differ) and
  ``all_to_all_single`` / ``alltoall_base`` (``dist.all_to_all_single``, with or without split
  sizes along dim 0): ``ProcessGroup.alltoall`` when the blocks are equal on every rank by
  construction (no split sizes), else ``alltoallv``, which first checks the ranks' counts
  against each other.
* ``monitored_barrier(timeout, wait_all_ranks)``: commlib's, naming the ranks that did not
  arrive. torch's ``dist.monitored_barrier`` refuses every backend but gloo, so call it on the
  group object (``dist.distributed_c10d._get_default_group().monitored_barrier(...)``).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

import commlib
from commlib import InvalidUsageError

from autograd_bridge.backend.profiling import profiled, profiled_p2p, tensors_of
from autograd_bridge.backend.staging import Staged, copy_back_all, single
from autograd_bridge.backend.validation import check_served

if TYPE_CHECKING:
    from autograd_bridge.backend.work import Completer

__all__ = ["ExchangeMethods", "P2PTorchWork"]


class P2PTorchWork(dist._Work):
    """A torch Work over a commlib point-to-point work."""

    def __init__(self, work, tensors, finish, completer):
        super().__init__()
        self._work = work
        self._tensors = tensors
        self._finish = finish
        self._finished = False
        self._lock = threading.Lock()
        self._completer = completer
        self._future = None
        self._held: Optional[threading.Event] = None

    @property
    def commlib_work(self) -> "commlib.Work":
        return self._work

    def hold_wait_until(self, event: threading.Event) -> None:
        """``wait()`` returns only once ``event`` is set too (the profiler's record closed: :mod:`.profiling`)."""
        self._held = event

    def wait(self, timeout=None) -> bool:
        self._work.wait()  # re-raises commlib's error (a timeout names rank, peer, tag, bytes)
        self._run_finish()
        if self._held is not None:
            self._held.wait()
        return True

    def _run_finish(self) -> None:
        with self._lock:
            if not self._finished and self._finish is not None:
                self._finish()
            self._finished = True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self):
        return self._work.exception()

    def _source_rank(self) -> int:
        self._work.wait()
        return self._work.source

    def source_rank(self) -> int:
        return self._source_rank()

    def result(self):
        self.wait()
        return self._tensors

    def synchronize(self) -> None:
        self.wait()

    def get_future(self):
        if self._future is None:
            self._future = self._completer.complete(_ASYNC, lambda _async_op: self._work, self._tensors,
                                                    self._run_finish).get_future()
        return self._future


class ExchangeMethods:
    # Provided by CommlibProcessGroup, which mixes this in (size: torch's ProcessGroup.size()).
    commlib_group: commlib.ProcessGroup
    _completer: Completer
    size: Callable[[], int]

    # -- point-to-point ------------------------------------------------------------------------
    @profiled_p2p("send")
    def send(self, tensors, dstRank: int, tag: int = 0):
        tensor = single(tensors, "send")
        check_served("send", tensor)
        staged = Staged(tensor, "send tensor")
        work = self.commlib_group.isend(staged.array, dstRank, tag)
        return P2PTorchWork(work, [staged.tensor], None, self._completer)

    @profiled_p2p("recv")
    def recv(self, tensors, srcRank: int, tag: int = 0):
        return self._receive(tensors, srcRank, tag)

    @profiled_p2p("recvAnySource")
    def recv_anysource(self, tensors, tag: int = 0):
        return self._receive(tensors, commlib.ANY_SOURCE, tag)

    def _receive(self, tensors, source: int, tag: int):
        tensor = single(tensors, "recv")
        check_served("recv", tensor)
        staged = Staged(tensor, "recv tensor")
        work = self.commlib_group.irecv(staged.array, source, tag)
        return P2PTorchWork(work, [staged.tensor], copy_back_all([staged]), self._completer)

    # -- all-to-all ----------------------------------------------------------------------------
    @profiled("all_to_all", lambda outputs, inputs, opts=None: tensors_of(inputs))
    def alltoall(self, output_tensors, input_tensors, opts=None):
        size = self.size()
        if len(output_tensors) != size or len(input_tensors) != size:
            raise InvalidUsageError(f"commlib backend: all_to_all takes one tensor per rank: got {len(input_tensors)} "
                                    f"inputs and {len(output_tensors)} outputs; expected world size {size}")
        for tensor in list(input_tensors) + list(output_tensors):
            check_served("all_to_all", tensor)
        dtype = input_tensors[0].dtype
        flat_in = torch.cat([t.detach().reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=dtype, device=flat_in.device)
        inp, out = Staged(flat_in, "all_to_all input"), Staged(flat_out, "all_to_all output")
        per_element = inp.array.size // flat_in.numel() if flat_in.numel() else 1  # complex: 2, float8: 1, ...
        out_counts = [t.numel() * per_element for t in output_tensors]
        in_counts = [t.numel() * per_element for t in input_tensors]
        group = self.commlib_group

        def finish():
            offset = 0
            for t in output_tensors:
                t.copy_(flat_out[offset:offset + t.numel()].view(t.shape))
                offset += t.numel()

        return self._completer.complete(
            opts or _ASYNC, lambda async_op: group.alltoallv(out.array, inp.array, out_counts, in_counts,
                                                             async_op=async_op),
            output_tensors, finish, inp.cuda_device, nbytes=inp.array.nbytes)

    @profiled("all_to_all", lambda output, input, *splits_and_opts, **named: [input])
    def all_to_all_single(self, output, input, output_split_sizes=(), input_split_sizes=(), opts=None):
        for tensor, what in ((output, "output"), (input, "input")):
            check_served("all_to_all_single", tensor, what)
        out, inp = Staged(output, "all_to_all_single output"), Staged(input, "all_to_all_single input")
        group = self.commlib_group
        if not output_split_sizes and not input_split_sizes:
            def issue(async_op):
                return group.alltoall(out.array, inp.array, async_op=async_op)
        else:
            out_counts = _split_counts(output, output_split_sizes, self.size(), "output", out.array.size)
            in_counts = _split_counts(input, input_split_sizes, self.size(), "input", inp.array.size)

            def issue(async_op):
                return group.alltoallv(out.array, inp.array, out_counts, in_counts, async_op=async_op)

        return self._completer.complete(opts or _ASYNC, issue, [output], copy_back_all([out]), out.cuda_device,
                                        nbytes=inp.array.nbytes)

    alltoall_base = all_to_all_single

    # -- the monitored barrier -----------------------------------------------------------------
    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """gloo's monitored barrier: rank 0 names the ranks that did not arrive within ``timeout``."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        self.commlib_group.monitored_barrier(seconds, wait_all_ranks=wait_all_ranks)


def _split_counts(tensor: torch.Tensor, splits, size: int, which: str, elements: int):
    """Element counts per rank from split sizes along dim 0 (empty: equal splits)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    per_row = elements // rows if rows else 0
    if not splits:
        if rows % size:
            raise InvalidUsageError(f"commlib backend: all_to_all_single: {which} has {rows} rows along dim 0, "
                                    f"not divisible by the world size {size}; pass {which}_split_sizes")
        splits = [rows // size] * size
    if len(splits) != size:
        raise InvalidUsageError(f"commlib backend: all_to_all_single: {which}_split_sizes has {len(splits)} "
                                f"entries; expected world size {size}")
    if sum(splits) != rows:
        raise InvalidUsageError(f"commlib backend: all_to_all_single: {which}_split_sizes add up to {sum(splits)} "
                                f"rows; expected {which}.shape[0] = {rows}")
    return [int(split) * per_row for split in splits]


class _AsyncOptions:
    asyncOp = True


_ASYNC = _AsyncOptions()
