"""PYTHONPATH=. mpiexec -n P python tests/mpi/efficient_dp_local_sgd_ranks.py

Local SGD's exact equivalences, float64 and plain SGD (no momentum), step by step:

* post-local SGD before ``start_localSGD_iter`` is plain DDP (rtol 1e-12); on one host, whose
  default subgroup is everyone, it stays DDP after the start too;
* local steps followed by periodic averaging with period 1 are DDP (rtol 1e-12);
* a one-level hierarchical averager is the periodic averager, bit for bit, for warm-ups 0..3 and
  periods 1..3; both average first at the end of warm-up (torch's hierarchical one counts from
  step 0), checked by the ranks' parameters being equal exactly at the expected steps;
* with an even world size, a two-level hierarchy averages pairs at the small period and
  everyone at the large one;
* an averager whose warm-up disagrees with the post-local SGD hook of its parameters raises;
* post-local SGD's default subgroup is this rank's host (on several hosts: tests/test_multihost.py);
* the partial averager averages every element exactly once per period, slice by slice as its
  ``schedule`` says (balanced and round-robin), one step after launching it;
* ``average_buffers=True`` averages BatchNorm's running statistics; bad arguments raise.
"""

import socket


import numpy as np
import torch
import torch.nn.functional as F

import commlib
from ddp import DistributedDataParallel as DDP
from ddp.averaging import HierarchicalModelAverager, PartialModelAverager, PeriodicModelAverager
from ddp.hooks import PostLocalSGDState, post_localSGD_hook
from ddp.optim import PostLocalSGDOptimizer
from ddp.subgroups import host_of_each_rank
from tests.support.verdict import Checker
from tests.support.small_training import batch, mlp

torch.set_num_threads(1)
STEPS = 8
START = 3
LR = 0.1


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def train(group, setup, steps=STEPS):
    """Parameters after each step of a DDP model set up by ``setup(model, optimizer) -> optimizer``."""
    model = DDP(mlp(), bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
    optimizer = setup(model, torch.optim.SGD(model.parameters(), lr=LR))
    trajectory = []
    for step in range(steps):
        x, y = batch(step, group.rank)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        trajectory.append(flat(model))
    return trajectory


def check_post_local_sgd_is_ddp(check, group):
    plain = train(group, lambda model, optimizer: optimizer)

    def post_local(allreduce_after_start):
        def setup(model, optimizer):
            state = PostLocalSGDState(None, None, start_localSGD_iter=START,
                                      post_local_gradient_allreduce=allreduce_after_start)
            model.register_comm_hook(state, post_localSGD_hook)
            return optimizer
        return setup

    local = train(group, post_local(False))
    for step in range(START):
        check.close(local[step], plain[step], f"post-local SGD step {step} (before start {START}) vs DDP",
                    rtol=1e-12, atol=0)
    if group.size > 1:
        check.check(not np.allclose(local[-1], plain[-1], rtol=1e-6),
                    "post-local SGD without gradient allreduce after the start still equals DDP: no local steps ran")
    if len(set(host_of_each_rank(group))) == 1:  # one host: the default subgroup is everyone
        on_host = train(group, post_local(True))
        for step in range(STEPS):
            check.close(on_host[step], plain[step], f"post-local SGD, one host, step {step} vs DDP",
                        rtol=1e-12, atol=0)


def check_period_one_is_ddp(check, group):
    plain = train(group, lambda model, optimizer: optimizer)

    def setup(model, optimizer):
        model.register_comm_hook(PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False),
                                 post_localSGD_hook)
        return PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(period=1, warmup_steps=START))

    averaged = train(group, setup)
    for step in range(STEPS):
        check.close(averaged[step], plain[step], f"local SGD + averaging every step, step {step} vs DDP",
                    rtol=1e-12, atol=0)


def local_sgd(group, averager, steps=10):
    """Local steps (no DDP) on rank-dependent data, the averager after each; parameters per step."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    trajectory = []
    for step in range(steps):
        x, y = batch(step, group.rank)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        averager.average_parameters(model.parameters())
        trajectory.append(flat(model))
    return trajectory


def equal_everywhere(group, params) -> bool:
    everyone = np.empty((group.size, params.size))
    group.allgather(everyone, params)
    return bool((everyone == everyone[0]).all())


def check_hierarchical_one_level_is_periodic(check, group):
    for warmup in range(4):
        for period in (1, 2, 3):
            periodic = local_sgd(group, PeriodicModelAverager(period, warmup_steps=warmup))
            hierarchical = local_sgd(group, HierarchicalModelAverager({period: group.size}, warmup_steps=warmup))
            for step, (a, b) in enumerate(zip(periodic, hierarchical)):
                check.equal(b, a, f"hierarchical {{{period}: {group.size}}} vs periodic, warmup {warmup}, step {step}")
            if group.size == 1:
                continue
            averaged = [equal_everywhere(group, params) for params in hierarchical]
            expected = [step >= warmup and (step - warmup) % period == 0 for step in range(len(averaged))]
            check.check(averaged == expected, f"warmup {warmup}, period {period}: ranks equal after steps "
                        f"{[s for s, a in enumerate(averaged) if a]}, "
                        f"expected {[s for s, e in enumerate(expected) if e]}")


def check_two_levels(check, group):
    if group.size % 2 or group.size < 4:
        return
    averager = HierarchicalModelAverager({2: 2, 4: group.size}, warmup_steps=1)
    trajectory = local_sgd(group, averager, steps=8)
    partner = group.rank ^ 1
    for step, params in enumerate(trajectory):
        everyone = np.empty((group.size, params.size))
        group.allgather(everyone, params)
        all_equal = bool((everyone == everyone[0]).all())
        pair_equal = bool((everyone[partner] == params).all())
        since = step - 1
        check.check(all_equal == (since >= 0 and since % 4 == 0),
                    f"two levels, step {step}: all ranks equal is {all_equal}")
        check.check(pair_equal == (since >= 0 and since % 2 == 0),
                    f"two levels, step {step}: pair ({group.rank}, {partner}) equal is {pair_equal}")


def check_partial_averages_each_element_once_per_period(check, group):
    """No training (lr 0), rank-dependent parameters: an element is equal on every rank exactly
    when its slice has been averaged; the slices follow ``.schedule``, one step late (the
    averaging of step t is applied at the end of step t+1)."""
    for strategy in ("balanced", "round_robin"):
        torch.manual_seed(group.rank)
        model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Linear(12, 3)).double()
        for param in model.parameters():
            param.grad = torch.zeros_like(param)
        warmup, period = 2, 3
        averager = PartialModelAverager(period, warmup_steps=warmup, module=model, schedule=strategy)
        sizes = [p.numel() for p in model.parameters()]
        offsets = np.cumsum([0] + sizes)
        averaged = np.zeros(offsets[-1], bool)
        for step in range(warmup + period + 1):
            averager.average_parameters(model.parameters())
            params = flat(model)
            everyone = np.empty((group.size, params.size))
            group.allgather(everyone, params)
            equal = (everyone == everyone[0]).all(axis=0)
            if step - 1 >= warmup:  # the slice launched at the previous call has landed
                names = [name for name, _ in model.named_parameters()]
                for name, start, stop in averager.schedule[(step - 1 - warmup) % period]:
                    base = offsets[names.index(name)]
                    averaged[base + start:base + stop] = True
            if group.size > 1:  # (on one rank everything is "equal on every rank")
                check.equal(equal, averaged, f"partial ({strategy}), after step {step}: elements equal on every rank")
                mean = everyone.mean(axis=0)
                check.close(params[averaged], mean[averaged], f"partial ({strategy}), step {step}: averaged elements",
                            rtol=1e-12, atol=0)
        check.check(averaged.all(), f"partial ({strategy}): not every element averaged within one period")
        per_step = [sum(stop - start for _, start, stop in pieces) for pieces in averager.schedule]
        if strategy == "balanced":
            check.check(max(per_step) - min(per_step) <= 1, f"balanced schedule uneven: {per_step}")


def check_buffers_and_bad_arguments(check, group):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)).double()
    model[1].running_mean.fill_(float(group.rank))
    model[1].running_var.fill_(float(group.rank + 1))
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    PeriodicModelAverager(1, average_buffers=True, module=model).average_parameters(model.parameters())
    mean = (group.size - 1) / 2
    check.close(model[1].running_mean, np.full(4, mean), "average_buffers: running_mean")
    check.close(model[1].running_var, np.full(4, mean + 1), "average_buffers: running_var")
    check.check(int(model[1].num_batches_tracked) == 0, "average_buffers touched an integer buffer")
    check.raises(ValueError, lambda: PeriodicModelAverager(1, average_buffers=True).average_parameters(
        model.parameters()), "average_buffers without the module", match="module")
    for what, make, match in (
            ("no levels", lambda: HierarchicalModelAverager({}), "at least one period"),
            ("last level not everyone", lambda: HierarchicalModelAverager({2: 1, 4: 1} if group.size > 1 else {2: 2}),
             "whole group"),
            ("decreasing periods", lambda: HierarchicalModelAverager({4: 1, 2: group.size}), "increasing"),
            ("period 0", lambda: PeriodicModelAverager(0), "period"),
            ("negative warm-up", lambda: PartialModelAverager(2, warmup_steps=-1), "warmup_steps"),
            ("unknown schedule", lambda: PartialModelAverager(2, schedule="random"), "schedule")):
        check.raises(ValueError, make, f"bad averager arguments: {what}", match=match)


def check_default_subgroup_is_the_host(check, group):
    """Post-local SGD's default subgroup: the ranks of this host (host names gathered over MPI here)."""
    names = group.comm.allgather(socket.gethostname())
    mine = [r for r, name in enumerate(names) if name == names[group.rank]]
    state = PostLocalSGDState(None, None, START)
    check.check(state.subgroup.size == len(mine),
                f"default subgroup of {state.subgroup.size} ranks; this host has {mine}")
    ones = np.ones(1)
    state.subgroup.allreduce(ones)
    check.check(ones[0] == len(mine),
                f"an allreduce over the default subgroup summed {ones[0]} ranks, expected {len(mine)}")


def check_warmup_mismatch_raises(check, group):
    model = DDP(mlp())
    model.register_comm_hook(PostLocalSGDState(None, None, START, post_local_gradient_allreduce=False),
                             post_localSGD_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    check.raises(ValueError, lambda: PostLocalSGDOptimizer(optimizer, PeriodicModelAverager(4, warmup_steps=START + 1)),
                 "PostLocalSGDOptimizer with warmup_steps != start_localSGD_iter", match="start_localSGD_iter=3")
    averager = HierarchicalModelAverager({4: group.size}, warmup_steps=START - 1)
    x, y = batch(0, group.rank)
    F.mse_loss(model(x), y).backward()
    check.raises(ValueError, lambda: averager.average_parameters(model.parameters()),
                 "averager with warmup_steps != start_localSGD_iter", match="warmup_steps=2")
    fine = PeriodicModelAverager(4, warmup_steps=START)
    fine.average_parameters(model.parameters())  # agrees: no error
    check.check(fine.step == 1, "the agreeing averager did not count its step")


def main():
    group = commlib.init()
    check = Checker()
    check_post_local_sgd_is_ddp(check, group)
    check_period_one_is_ddp(check, group)
    check_hierarchical_one_level_is_periodic(check, group)
    check_two_levels(check, group)
    check_warmup_mismatch_raises(check, group)
    check_default_subgroup_is_the_host(check, group)
    check_partial_averages_each_element_once_per_period(check, group)
    check_buffers_and_bad_arguments(check, group)
    check.finish()


if __name__ == "__main__":
    main()
