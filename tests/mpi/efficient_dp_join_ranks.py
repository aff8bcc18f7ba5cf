"""PYTHONPATH=. mpiexec -n P python tests/mpi/efficient_dp_join_ranks.py

Uneven inputs under ``ddp.Join``: rank r has 20 + 3r batches. In every case every rank leaves
the ``with`` block (a hang is the test's timeout) and ends with bitwise identical parameters:

* our DDP, both divisions: allclose (rtol 1e-10, float64) to torch's DDP under torch's Join on a
  gloo group of the same job, same data and initial weights (P=2: additions of two numbers in
  either order are equal; P=3: torch divides each gradient before summing, we after);
* our DDP with PowerSGD (compressing from step 2), with ``no_sync`` micro-batches, with
  ``find_unused_parameters`` and BatchNorm buffers, and with post-local SGD plus each averager
  (periodic, hierarchical, partial) in ``Join([model, averager])``;
* the averagers average over the ranks still in: every rank adds c_r to its parameters each
  step and averages every step; the parameters must follow p += mean of c_r over the active ranks
  (rtol 1e-12: a joined rank contributing its stale parameters, or counted in the divisor, is off
  by far more), for a small parameter and for one averaged in its own memory;
* ``throw_on_early_termination=True`` raises ``RuntimeError`` on every rank in one iteration;
* Joinables listed out of order (``[averager, model]``), or an averager the Join does not list,
  raise ``RuntimeError`` on every rank.
"""



import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join as TorchJoin

import autograd_bridge
import commlib
from ddp import DistributedDataParallel as DDP
from ddp import Join
from ddp.averaging import HierarchicalModelAverager, PartialModelAverager, PeriodicModelAverager
from ddp.hooks import PostLocalSGDState, PowerSGDState, post_localSGD_hook, powerSGD_hook
from ddp.optim import PostLocalSGDOptimizer
from tests.support.verdict import Checker

torch.set_num_threads(1)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).double()


def batches(rank):
    generator = torch.Generator().manual_seed(rank)
    return [(torch.randn(4, 8, generator=generator, dtype=torch.float64),
             torch.randn(4, 4, generator=generator, dtype=torch.float64)) for _ in range(20 + 3 * rank)]


def flat(module):
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).numpy().copy()


def check_identical(check, group, params, what):
    everyone = np.empty((group.size, params.size))
    group.allgather(everyone, params)
    for other in range(group.size):
        check.equal(everyone[other], params, f"{what}: rank {other}'s parameters vs rank {group.rank}'s")
    check.check(np.isfinite(params).all(), f"{what}: parameters not finite")


def train(model, optimizer, data, join, micro=1):
    with join:
        for index, (x, y) in enumerate(data):
            if micro > 1 and index % micro != micro - 1:
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
                continue
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()


def check_ddp_matches_torch(check, group, gloo):
    for divide in (True, False):
        ours = DDP(mlp())
        optimizer = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
        train(ours, optimizer, batches(group.rank), Join([ours], divide_by_initial_world_size=divide))
        theirs = torch.nn.parallel.DistributedDataParallel(mlp(), process_group=gloo)
        optimizer = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
        train(theirs, optimizer, batches(group.rank), TorchJoin([theirs], divide_by_initial_world_size=divide))
        what = f"DDP + Join (divide_by_initial_world_size={divide})"
        check_identical(check, group, flat(ours.module), what)
        check.close(flat(ours.module), flat(theirs.module), f"{what} vs torch's on gloo", rtol=1e-10, atol=1e-12)
        check.check(not np.allclose(flat(ours.module), flat(mlp())), f"{what}: nothing trained")


def check_hooks_and_no_sync(check, group):
    model = DDP(mlp(), bucket_cap_mb=0.002, first_bucket_cap_mb=0.002)
    state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=2)
    model.register_comm_hook(state, powerSGD_hook)
    train(model, torch.optim.SGD(model.parameters(), lr=0.05), batches(group.rank), model.join())
    check_identical(check, group, flat(model.module), "PowerSGD + Join")
    check.check(state.iter == 20 + 3 * (group.size - 1) and state.q_memory_dict,
                f"PowerSGD + Join: {state.iter} iterations counted (every rank counts the longest run's)")

    model = DDP(mlp())
    train(model, torch.optim.SGD(model.parameters(), lr=0.05), batches(group.rank), model.join(), micro=2)
    check_identical(check, group, flat(model.module), "no_sync micro-batches + Join")

    # find_unused_parameters: a joined rank also shadows the used-parameter map's allreduce;
    # the BatchNorm's buffers are broadcast before every forward (from the lowest active rank).
    torch.manual_seed(0)
    net = torch.nn.ModuleDict({"body": torch.nn.Linear(8, 16), "bn": torch.nn.BatchNorm1d(16),
                               "head": torch.nn.Linear(16, 4), "unused": torch.nn.Linear(16, 4)}).double()

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net["head"](torch.tanh(self.net["bn"](self.net["body"](x))))

    model = DDP(Branchy(), find_unused_parameters=True)
    train(model, torch.optim.SGD(model.parameters(), lr=0.05), batches(group.rank), model.join())
    check_identical(check, group, flat(model.module), "find_unused_parameters + BatchNorm + Join")
    buffers = torch.cat([b.double().reshape(-1) for b in model.module.buffers()]).numpy()
    check_identical(check, group, buffers, "BatchNorm buffers after Join")


def check_averagers(check, group):
    makers = {"periodic": lambda: PeriodicModelAverager(3, warmup_steps=4),
              "hierarchical": lambda: HierarchicalModelAverager({2: 1, 3: group.size}, warmup_steps=4),
              "partial": lambda: PartialModelAverager(3, warmup_steps=4)}
    for name, make in makers.items():
        model = DDP(mlp())
        model.register_comm_hook(PostLocalSGDState(None, None, 4, post_local_gradient_allreduce=False),
                                 post_localSGD_hook)
        averager = make()
        optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), averager)
        train(model, optimizer, batches(group.rank), Join([model, averager]))
        check_identical(check, group, flat(model.module), f"local SGD + {name} averager + Join")
        check.check(averager.step == 20 + 3 * (group.size - 1), f"{name}: step {averager.step} after Join")


def check_average_over_active_ranks(check, group):
    for name, averager in (("periodic", PeriodicModelAverager(1)),
                           ("hierarchical", HierarchicalModelAverager({1: group.size})),
                           ("partial", PartialModelAverager(1))):
        # A small parameter (packed with others) and one of 1.1 MiB (averaged in its own memory).
        params = [torch.nn.Parameter(torch.zeros(size, dtype=torch.float64)) for size in (3, 140_000)]
        for param in params:
            param.grad = torch.zeros_like(param)
        steps = 5 + 2 * group.rank
        expected, previous_common, trajectory = 0.0, 0.0, []
        with Join([averager]):
            for step in range(steps):
                with torch.no_grad():
                    for param in params:
                        param += float(group.rank + 1)  # c_r = r + 1
                averager.average_parameters(params)
                values = torch.cat([param.detach() for param in params])
                # The two sizes may take different allreduce algorithms: the order of the sum differs.
                check.close(values, np.full(values.numel(), values[0].item()), f"{name}: step {step}: the two "
                            f"parameters", rtol=1e-12, atol=0)
                trajectory.append(values[0].item())
        averager.finish()
        for step, value in enumerate(trajectory):
            active = [r for r in range(group.size) if 5 + 2 * r > step]
            if name == "partial":  # averaged one step later: the average of step-1, plus this step's own c_r
                if step == 0:
                    expected = float(group.rank + 1)
                else:
                    before = [r for r in range(group.size) if 5 + 2 * r > step - 1]
                    expected = previous_common + np.mean([r + 1 for r in before]) + (group.rank + 1)
                previous_common = expected - (group.rank + 1)
            else:
                expected += np.mean([r + 1 for r in active])
            check.check(np.isclose(value, expected, rtol=1e-12, atol=0), f"{name} under Join, step {step}: "
                        f"{value}, expected {expected} (active ranks {active})")


def check_bad_joinables(check, group):
    check.raises(ValueError, lambda: Join([]), "Join([])", match="at least one")
    check.raises(TypeError, lambda: Join([object()]), "Join([object()])", match="not a Joinable")


def check_throw_and_order(check, group):
    model = DDP(mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    check.raises(RuntimeError, lambda: train(model, optimizer, batches(group.rank),
                                             model.join(throw_on_early_termination=True)),
                 "throw_on_early_termination", match="exhausted")
    averager = PeriodicModelAverager(2)
    optimizer = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), averager)
    check.raises(RuntimeError, lambda: train(model, optimizer, batches(group.rank), Join([averager, model])),
                 "Join([averager, model])", match="order")
    check.raises(RuntimeError, lambda: train(model, optimizer, batches(group.rank), Join([model])),
                 "Join([model]) while an averager is used", match="does not list it")


def main():
    autograd_bridge.init_process_group()
    group = commlib.world()
    gloo = dist.new_group(backend="gloo")
    check = Checker()
    check_ddp_matches_torch(check, group, gloo)
    check_hooks_and_no_sync(check, group)
    check_averagers(check, group)
    check_average_over_active_ranks(check, group)
    check_bad_joinables(check, group)
    check_throw_and_order(check, group)
    dist.destroy_process_group()
    check.finish()


if __name__ == "__main__":
    main()
