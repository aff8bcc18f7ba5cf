"""The reducer: bucket memory, gradient readiness, launching allreduces, and the end of backward.

One iteration, as in the paper (Li et al., section 3.2):

* ``prepare(outputs)`` (from DDP's forward) arms the reducer; with ``find_unused_parameters`` it
  walks the autograd graph from the outputs to find the parameters backward will not reach.
* Each parameter's grad-ready hook copies its gradient into its slot of a bucket (or, with
  ``gradient_as_bucket_view``, makes ``.grad`` that slot) and counts the bucket down. A bucket at
  zero is ready; ready buckets are launched strictly in index order (bucket 3 waits for bucket 2
  even if it filled first) so that every rank issues the same collectives in the same order.
  The first hook of a backward also queues the final callback and marks the unused parameters.
* The final callback waits for every bucket in order, writes the averaged gradients back and
  resets. An error (a parameter without gradient, a failed collective) is raised from it, so it
  comes out of ``loss.backward()``.

After the first synchronised backward the buckets are rebuilt once, in the order the gradients
actually became ready on rank 0 (broadcast, so that every rank builds the same plan).
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from autograd_bridge import autograd_hooks
from autograd_bridge.tensors import from_array, symmetric_zeros, to_array
from commlib import ReduceOp, Work

from autograd_bridge.cuda_streams import on_torch_stream
from ddp.bucketing import BucketPlan, ParamSpec, plan_buckets
from ddp.hooks import CommHook, GradBucket, HookResult, allreduce_hook
from ddp.stats import ByteCounter, StepStats

__all__ = ["Reducer", "param_specs"]


def param_specs(params: Sequence[torch.Tensor]) -> List[ParamSpec]:
    return [ParamSpec(p.numel(), p.element_size(), str(p.dtype).replace("torch.", ""), str(p.device))
            for p in params]


def _wait_for_result(work: Optional[HookResult]):
    """The reduced buffer of a hook's handle: a :class:`commlib.WorkHandle` (``result()``) or a
    ``torch.futures.Future`` (``wait()`` returns the value; torch-style hooks return ``[tensor]``)."""
    assert work is not None  # only launched buckets are waited for
    if hasattr(work, "result"):
        result = work.result()
    else:
        result = work.wait()
    if isinstance(result, (list, tuple)) and len(result) == 1:
        result = result[0]
    return result


class _Bucket:
    __slots__ = ("index", "plan", "flat", "array", "views", "params", "nbytes", "pending", "work",
                 "launched_at", "_done_at", "sent")

    def __init__(self, index: int, plan: BucketPlan, params: Sequence[torch.Tensor], group=None):
        first = params[plan.params[0]]
        self.index = index
        self.plan = plan
        # In the group's shared memory where that helps (one host): the allreduce then reads the
        # peers' buckets in place, and with gradient_as_bucket_view autograd writes the
        # gradients straight there, so a gradient is never copied on its way to the average.
        flat = symmetric_zeros(group, plan.numel, first.dtype, first.device)
        if flat is None:
            flat = torch.zeros(plan.numel, dtype=first.dtype, device=first.device)
        self.flat = flat
        self.array = to_array(self.flat)
        self.views = [self.flat[offset:offset + params[i].numel()].view(params[i].shape)
                      for i, offset in zip(plan.params, plan.offsets)]
        self.params = plan.params
        self.nbytes = self.flat.numel() * self.flat.element_size()
        self.sent = ByteCounter()  # payload the bucket's reduction handed to collectives this step
        self.reset()

    def reset(self) -> None:
        self.pending = len(self.params)
        self.work = None
        self.launched_at: Optional[float] = None
        self._done_at: Optional[float] = None
        self.sent.reset()

    def launched(self, work) -> None:
        self.work = work
        if not isinstance(self._collective_work(), Work):
            # A hook's own handle (a torch Future...): timestamp its completion with a callback.
            work.add_done_callback(self._record_done)

    def _collective_work(self):
        return getattr(self.work, "work", self.work)  # a HookWork wraps the collective's Work

    def _record_done(self, _work) -> None:
        self._done_at = time.perf_counter()

    @property
    def done_at(self) -> Optional[float]:
        """When the bucket's collective completed (``time.perf_counter``), None until then."""
        work = self._collective_work()
        return work.completed_at if isinstance(work, Work) else self._done_at


class Reducer:
    def __init__(self, params: List[torch.Tensor], names: List[str], group, *, cap_bytes: float,
                 first_cap_bytes: float, gradient_as_bucket_view: bool, find_unused_parameters: bool,
                 algorithm: str, tracer=None):
        self.params = params
        self.names = names
        self.group = group
        self.cap_bytes = cap_bytes
        self.first_cap_bytes = first_cap_bytes
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.find_unused_parameters = find_unused_parameters
        self.algorithm = algorithm
        self.tracer = tracer
        self.comm_hook: CommHook = allreduce_hook
        self.comm_hook_state = None
        self.specs = param_specs(params)
        self._trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self._build(plan_buckets(self.specs, cap_bytes, first_cap_bytes,
                                 order=self._reverse_order()))
        self._rebuilt = False
        self._ready_order: List[int] = []
        self._armed = False        # a synchronised forward prepared this backward
        self._skip_hooks = False   # the last forward ran under no_sync()
        self._in_backward = False  # a hook fired; the final callback is queued
        self._ready = [False] * len(params)
        self._unused: List[int] = []
        self._local_used = np.zeros(len(params), dtype=np.int32)
        self._next_launch = 0
        self._backward_started_at: Optional[float] = None
        self._last_stats: Optional[dict] = None
        self._divisor: Optional[int] = None  # Join(divide_by_initial_world_size=False): ranks still in
        self._handles = autograd_hooks.register_grad_ready_hooks(params, self._on_grad_ready)

    # -- buckets -------------------------------------------------------------------------------
    def _reverse_order(self) -> List[int]:
        return list(range(len(self.params) - 1, -1, -1))

    def _build(self, plans: List[BucketPlan]) -> None:
        self.buckets = [_Bucket(i, plan, self.params, self.group) for i, plan in enumerate(plans)]
        self._slot: Dict[int, Tuple[_Bucket, torch.Tensor]] = {}  # param index -> (bucket, view)
        for bucket in self.buckets:
            for index, view in zip(bucket.params, bucket.views):
                self._slot[index] = (bucket, view)
        if self.gradient_as_bucket_view:
            for index, param in enumerate(self.params):
                if param.grad is not None:
                    self._slot[index][1].copy_(param.grad)
                    param.grad = self._slot[index][1]

    def bucket_sizes(self) -> List[int]:
        return [bucket.nbytes for bucket in self.buckets]

    def set_comm_hook(self, state, hook: CommHook) -> None:
        if not callable(hook):
            raise TypeError(f"register_comm_hook: hook must be callable, got {type(hook).__name__}")
        self.comm_hook, self.comm_hook_state = hook, state

    # -- one iteration -------------------------------------------------------------------------
    def check_previous_backward(self) -> None:
        """At each forward: raise if the last backward started reducing and never reached its end."""
        if self._in_backward:
            self._abandon_backward()

    def prepare(self, outputs, *, sync: bool) -> None:
        """Called by DDP's forward (with grad enabled): arm the next backward, or skip it (no_sync)."""
        self._armed, self._skip_hooks = sync, not sync
        if not sync:
            return
        self._reset_iteration()
        if self.find_unused_parameters:
            self._unused = autograd_hooks.find_unreachable(outputs, self.params)

    def _reset_iteration(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._ready = [False] * len(self.params)
        self._local_used[:] = 0
        self._next_launch = 0
        self._backward_started_at = None
        self._ready_order = []  # only a complete backward's order counts for the rebuild

    def _on_grad_ready(self, index: int) -> None:
        if not self._armed:
            if self._skip_hooks:
                return
            raise RuntimeError(
                f"DDP (rank {self.group.rank}): gradient of {self.names[index]!r} computed by a "
                f"backward pass that no DDP forward prepared (backward twice after one forward, or "
                f"through model.module); it would not be averaged across ranks. Call the DDP "
                f"model's forward before each backward (or use no_sync() to accumulate locally)")
        if not self._in_backward:
            self._in_backward = True
            self._backward_started_at = time.perf_counter()
            autograd_hooks.queue_final_callback(self._finalize)
            for unused in self._unused:
                if not self._ready[unused]:
                    self._mark_ready(unused, used=False)
        if self._ready[index]:
            raise RuntimeError(
                f"DDP (rank {self.group.rank}): parameter {self.names[index]!r} received its "
                f"gradient twice in one backward pass (a second backward through the same graph, "
                f"or a reentrant checkpoint); DDP reduces each gradient once per forward")
        self._mark_ready(index, used=True)

    def _mark_ready(self, index: int, *, used: bool) -> None:
        bucket, view = self._slot[index]
        param = self.params[index]
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.is_sparse:
            raise RuntimeError(f"DDP: parameter {self.names[index]!r} has a sparse gradient; "
                               f"sparse gradients are not supported")
        elif self.gradient_as_bucket_view:
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
                param.grad = view
        else:
            view.copy_(grad)
        self._ready[index] = True
        if used:
            self._local_used[index] = 1
        if not self._rebuilt:
            self._ready_order.append(index)
        bucket.pending -= 1
        if bucket.pending == 0:
            if self.tracer is not None:
                self.tracer.instant("bucket_ready", "compute", time.perf_counter(),
                                    {"bucket": bucket.index, "bytes": bucket.nbytes,
                                     "params": len(bucket.params)})
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        buckets = self.buckets
        while self._next_launch < len(buckets) and buckets[self._next_launch].pending == 0:
            bucket = buckets[self._next_launch]
            grad_bucket = GradBucket(bucket.index, bucket.flat, bucket.array,
                                     [self.params[i] for i in bucket.params],
                                     bucket.index == len(buckets) - 1, self.group, self.algorithm,
                                     gradients=bucket.views, param_indices=bucket.params,
                                     counter=bucket.sent)
            bucket.launched_at = time.perf_counter()
            with on_torch_stream(bucket.flat.device):
                if self._sum_then_divide_on_write_back():
                    # The default hook's average, with the division folded into the copy back
                    # to .grad: one pass over the gradients less than SUM-then-divide-then-copy.
                    bucket.sent.add(bucket.nbytes)
                    work = self.group.allreduce(bucket.array, ReduceOp.SUM, algorithm=self.algorithm,
                                                async_op=True)
                else:
                    work = self.comm_hook(self.comm_hook_state, grad_bucket)
            bucket.launched(work)
            self._next_launch += 1  # only once launched: a hook that raised leaves nothing to wait for

    def _default_divisor(self) -> int:
        return self.group.size if self._divisor is None else self._divisor

    def set_divisor(self, divisor: Optional[int]) -> None:
        """Average the default hook's sums over ``divisor`` ranks this step (None: the group size)."""
        self._divisor = divisor

    def _sum_then_divide_on_write_back(self) -> bool:
        return (self.comm_hook is allreduce_hook and self.comm_hook_state is None
                and not self.gradient_as_bucket_view and self.group.size > 1)

    # -- the end of backward ---------------------------------------------------------------------
    def _finalize(self) -> None:
        backward_end = time.perf_counter()
        self._in_backward = False
        self._armed = False
        missing = [i for i in self._trainable if not self._ready[i]]
        error = self._wait_all_launched()
        if error is None and missing:
            error = self._missing_gradients_error(missing)
        if error is None:
            self._write_back()
            self._last_stats = StepStats.from_buckets(self.buckets, self._backward_started_at,
                                                      backward_end, time.perf_counter())
            self._trace(backward_end)
            if not self._rebuilt:
                self._rebuild_in_ready_order()
        if error is not None:
            raise error

    def _wait_all_launched(self) -> Optional[BaseException]:
        """Wait for every launched bucket (even after a failure, so none is left in flight)."""
        error = None
        for bucket in self.buckets[:self._next_launch]:
            try:
                with on_torch_stream(bucket.flat.device):
                    result = _wait_for_result(bucket.work)
                self._copy_result(bucket, result)
            except Exception as exc:  # noqa: BLE001 - the first one is re-raised by the caller
                if error is None:
                    error = exc
        return error

    @staticmethod
    def _copy_result(bucket: _Bucket, result) -> None:
        if result is None or result is bucket.flat or result is bucket.array:
            return
        if not isinstance(result, torch.Tensor):
            result = from_array(result)
        if result.data_ptr() != bucket.flat.data_ptr():
            if result.numel() != bucket.flat.numel():
                raise RuntimeError(f"DDP: comm hook returned {result.numel()} elements for bucket "
                                   f"{bucket.index}; expected {bucket.flat.numel()}")
            bucket.flat.copy_(result.reshape(-1))

    def _missing_gradients_error(self, missing: List[int]) -> RuntimeError:
        shown = ", ".join(repr(self.names[i]) for i in missing[:10])
        more = f" and {len(missing) - 10} more" if len(missing) > 10 else ""
        first_bucket = min(self._slot[i][0].index for i in missing)
        return RuntimeError(
            f"DDP (rank {self.group.rank}): {len(missing)} parameter(s) received no gradient in this "
            f"backward pass: {shown}{more}; bucket {first_bucket} and the ones after it were never "
            f"reduced. If some parameters legitimately take no part in the loss, construct DDP with "
            f"find_unused_parameters=True; otherwise make every forward output take part in the loss")

    def _write_back(self) -> None:
        globally_used = None
        if self.find_unused_parameters:
            # A parameter nobody used keeps its .grad (None stays None), as on a single process.
            # Every rank takes part even when it used everything: which parameters a rank used
            # may depend on its data.
            globally_used = self._local_used.copy()
            self.group.allreduce(globally_used)
        divisor = self._default_divisor() if self._sum_then_divide_on_write_back() else None
        if divisor is None and self._divisor is not None and self.comm_hook is allreduce_hook:
            # The default hook averaged over the whole group; Join asked for the ranks still in.
            for bucket in self.buckets[:self._next_launch]:
                bucket.flat.mul_(self.group.size / self._divisor)
        for index in self._trainable:
            if globally_used is not None and not globally_used[index]:
                continue
            param = self.params[index]
            view = self._slot[index][1]
            if self.gradient_as_bucket_view:
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view
            elif divisor is not None:
                if param.grad is None:
                    param.grad = torch.div(view, divisor)
                else:
                    torch.div(view, divisor, out=param.grad)
            elif param.grad is None:
                param.grad = view.clone()
            else:
                param.grad.copy_(view)

    def _trace(self, backward_end: float) -> None:
        if self.tracer is None:
            return
        for bucket in self.buckets:
            if bucket.launched_at is not None and bucket.done_at is not None:
                self.tracer.span("allreduce", "comm", bucket.launched_at, bucket.done_at,
                                 {"bucket": bucket.index, "bytes": bucket.nbytes,
                                  "algorithm": self._algorithm_of(bucket)})
        self.tracer.span("finalize", "compute", backward_end, time.perf_counter(), {})

    def _algorithm_of(self, bucket: _Bucket) -> str:
        """The algorithm the bucket's allreduce ran ("auto" resolved); a user hook may differ."""
        resolve = getattr(self.group, "resolve_algorithm", None)
        if resolve is None:
            return self.algorithm
        return resolve(self.algorithm, bucket.nbytes, bucket.flat.device.type == "cuda")

    def _rebuild_in_ready_order(self) -> None:
        """Once: rebuild the buckets in rank 0's observed gradient order (every rank, same plan)."""
        self._rebuilt = True
        seen = set(self._ready_order)
        order = self._ready_order + [i for i in self._reverse_order() if i not in seen]
        self._ready_order = []
        order_array = np.asarray(order, dtype=np.int64)
        self.group.broadcast(order_array, 0)
        plans = plan_buckets(self.specs, self.cap_bytes, self.first_cap_bytes, order=order_array.tolist())
        if plans != [bucket.plan for bucket in self.buckets]:
            self._build(plans)

    def _abandon_backward(self) -> None:
        """A forward after a backward whose final callback never ran (the backward failed midway)."""
        self._in_backward = False
        self._armed = False
        error = self._wait_all_launched()
        missing = [i for i in self._trainable if not self._ready[i]]
        if error is None:
            error = self._missing_gradients_error(missing) if missing else RuntimeError(
                f"DDP (rank {self.group.rank}): the previous backward pass did not finish")
        raise RuntimeError(f"DDP: forward called before the previous backward finished reducing "
                           f"gradients: {error}") from error

    # -- Join: a joined rank's part in the others' backward --------------------------------------
    def shadow_backward(self) -> None:
        """The collectives of one synchronised backward, with zero gradients, in the same order:
        every bucket through the same path (the default allreduce or the comm hook, whose state
        advances as on the other ranks), the used-parameter map, the one-time rebuild's broadcast."""
        self.check_previous_backward()
        self._reset_iteration()
        self._armed = False
        started = time.perf_counter()
        for bucket in self.buckets:
            bucket.flat.zero_()
            bucket.pending = 0
        self._launch_ready_buckets()
        error = self._wait_all_launched()
        if error is not None:
            raise error
        if self.find_unused_parameters:
            self.group.allreduce(np.zeros(len(self.params), dtype=np.int32))
        self._last_stats = StepStats.from_buckets(self.buckets, started, started, time.perf_counter())
        if not self._rebuilt:
            self._rebuild_in_ready_order()

    # -- introspection -------------------------------------------------------------------------
    def last_stats(self) -> Optional[dict]:
        return None if self._last_stats is None else dict(self._last_stats)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
