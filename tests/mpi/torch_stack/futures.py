"""A small async collective on an idle group runs at once, and its future keeps the group's order.

DTensor and the functional collectives issue every collective async and wait for it at once;
the backend runs such a call in the caller's thread when nothing is in flight (see
``autograd_bridge.backend.work``). Its Work is then complete on return, and a callback attached
to its future must still run as for any completed collective: on the communication thread, at
the place of the issue order where it was attached, so a collective it issues gets the same
sequence number on every rank.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
import torch.distributed as dist

from autograd_bridge.backend.work import EAGER_BYTES


def check_eager_futures(checker):
    size, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD.commlib_group
    dist.barrier()  # nothing in flight below
    small = torch.full((16,), float(rank + 1))
    work = dist.all_reduce(small, async_op=True)
    checker.check(work.is_completed(), "a small async all_reduce on an idle group was not complete on return")
    total = float(size * (size + 1) // 2)
    checker.equal(small.numpy(), np.full(16, total), "eager all_reduce")
    seen = {}
    nested = torch.full((3,), 10.0 * (rank + 1))

    def callback(future):
        seen["thread"] = threading.current_thread().name
        seen["seq"] = group.seq
        dist.all_reduce(nested)
        return future.value()

    chained = work.get_future().then(callback)
    after = torch.full((3,), 100.0 * (rank + 1))
    dist.all_reduce(after)  # issued after the callback was attached: runs after it
    value = chained.wait()
    checker.check(value[0] is small, "the chained future's value is not the all_reduce's tensor")
    checker.check(seen.get("thread", "").startswith("commlib-"), f"the callback ran on {seen.get('thread')}")
    checker.equal(nested.numpy(), np.full(3, 10.0 * total), "all_reduce issued from the callback")
    checker.equal(after.numpy(), np.full(3, 100.0 * total), "all_reduce issued after attaching")
    seqs = [None] * size
    dist.all_gather_object(seqs, seen.get("seq"))
    checker.check(len(set(seqs)) == 1, f"the callback ran at different places of the order: {seqs}")
    # A large one still goes through the communication thread (its Work may or may not be done).
    large = torch.ones(EAGER_BYTES // 4 + 1)
    dist.all_reduce(large, async_op=True).wait()
    checker.equal(large.numpy()[:4], np.full(4, float(size)), "a large async all_reduce")
