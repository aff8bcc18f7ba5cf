"""PYTHONPATH=. mpiexec -n P python tests/mpi/low_communication_ranks.py [ALGORITHM]

DiLoCo, Streaming DiLoCo and DES-LOC against the single-process references of
tests/support/low_communication_reference.py (P workers simulated on the ranks' data, float64):

* every rank's parameters after every step equal the reference's (rtol 1e-10): DiLoCo; streaming
  with a count of fragments, delay and alpha; with modules as fragments; with bfloat16 and float16
  outer gradients (bfloat16's rounding where the sum order is the algorithm's); after 3 steps of DDP;
  DES-LOC's parameters and both moments; under ``Join`` with uneven inputs (alone, and after a DDP
  model with its warm-up), at the end;
* the fragment in flight at each step is the schedule's, ``bytes_sent`` grows at the launches
  only and totals the formula (exact integers);
* repeated runs give the same bits; a run stopped (a fragment in flight) and resumed from
  ``state_dict()`` gives the bits of an uninterrupted one;
* DiLoCo with outer SGD lr 1 is local SGD with the periodic model averager; one outer optimizer
  per fragment (torchft's list) is one over all, bit for bit;
* DES-LOC with Kx = Ku = Kv = 1 against DDP + Adam: equal with the same data everywhere; with
  different data the first moment equal, the second larger by (1 - beta2) x the ranks' gradient
  variance, the parameters at the closed form of the averaged sign-like steps (not DDP's);
* bad arguments raise before anything is sent; a DDP model gets the post-local SGD hook.

``ALGORITHM`` (default auto) is the methods' allreduce: tests/multihost runs this with
``hierarchical`` on 2 hosts x 2 ranks, and checks that ``auto`` takes it there for large models.
"""

import io
import sys

import numpy as np
import torch
import torch.nn.functional as F

import commlib
import ddp
from ddp.averaging import PeriodicModelAverager
from ddp.hooks import PostLocalSGDState, PowerSGDState, post_localSGD_hook, powerSGD_hook
from ddp.low_communication.fragments import launches_within
from ddp.subgroups import host_of_each_rank
from tests.support.verdict import Checker
from tests.support import low_communication_reference as reference
from tests.support.small_training import batch, mlp

torch.set_num_threads(1)
INNER = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
OUTER = {"lr": 0.7, "momentum": 0.9}
TIGHT = {"rtol": 1e-10, "atol": 1e-12}
ALGORITHM = sys.argv[1] if len(sys.argv) > 1 else "auto"


def flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).numpy().copy()


def train(model, optimizer, method, first, last, rank, record=None, data=batch):
    """Steps ``first..last-1`` inside ``method``'s context; per step (params, in flight, bytes)."""
    with method:
        for step in range(first, last):
            x, y = data(step, rank)
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            if record is not None:
                record.append((flat(model.parameters()), getattr(method, "in_flight", None), method.bytes_sent))
    return record


def diloco(fragments=None, wrap=None, **options):
    model = mlp()
    model = wrap(model) if wrap else model
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    outer = torch.optim.SGD(model.parameters(), nesterov=True, **OUTER)
    modules = getattr(model, "module", model)
    chosen = fragments(modules) if callable(fragments) else fragments
    return model, inner, ddp.DiLoCo(model, inner, outer, fragments=chosen, algorithm=ALGORITHM, **options)


# (name, DiLoCo options, reference fragments, steps): the MLP's parameters are
# [72, 12, 144, 12, 36, 3] elements; 3 fragments by count cut near 1/3 and 2/3 of the total.
CASES = [
    ("diloco H=3", {"sync_every": 3}, [[0, 1, 2, 3, 4, 5]], 9),
    ("streaming F=3 tau=1 alpha=0.5", {"sync_every": 6, "fragments": 3, "fragment_sync_delay": 1,
                                       "fragment_update_alpha": 0.5}, [[0, 1], [2], [3, 4, 5]], 14),
    ("streaming modules tau=2", {"sync_every": 9, "fragments": lambda m: [m[4], m[0], m[2]],
                                 "fragment_sync_delay": 2}, [[4, 5], [0, 1], [2, 3]], 12),
    ("streaming bf16 F=2 tau=1", {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1,
                                  "outer_dtype": torch.bfloat16}, None, 10),
    ("float16 H=2", {"sync_every": 2, "outer_dtype": torch.float16}, None, 6),
]


def reference_run(options, parts, steps, size, steps_of=None, warmup=0):
    return reference.diloco(mlp(), batch, steps_of or [steps] * size, sync_every=options["sync_every"],
                            fragments=parts, delay=options.get("fragment_sync_delay", 0),
                            alpha=options.get("fragment_update_alpha", 0.0), inner=dict(INNER), outer_lr=OUTER["lr"],
                            outer_momentum=OUTER["momentum"], wire_dtype=options.get("outer_dtype"), warmup=warmup)


def expected_flight(options, offsets, t):
    """The fragment whose synchronisation is on its way after step t, by the schedule."""
    position, delay = (t - 1) % options["sync_every"] + 1, options.get("fragment_sync_delay", 0)
    for index, offset in enumerate(offsets):
        if offset - delay <= position < offset:
            return index
    return None


def check_diloco_matches_reference(check, group):
    for name, options, parts, steps in CASES:
        model, inner, method = diloco(**options)
        index_of = {id(p): i for i, p in enumerate(model.parameters())}
        got_parts = [[index_of[id(p)] for p in fragment.params] for fragment in method.fragments]
        if parts is not None:
            check.check(got_parts == parts, f"{name}: fragments {got_parts}, expected {parts}")
        record = train(model, inner, method, 0, steps, group.rank, [])
        expected = reference_run(options, got_parts, steps, group.size)
        wire = options.get("outer_dtype")
        # 16-bit sums of 3+ terms round differently in another order: two bfloat16 ulps.
        tolerance = {"rtol": 2e-2, "atol": 1e-3} if wire is not None and group.size > 2 else TIGHT
        offsets = [fragment.offset for fragment in method.fragments]
        sizes = [sum(p.numel() for p in fragment.params) for fragment in method.fragments]
        element = (torch.finfo(wire).bits if wire is not None else 64) // 8
        delay = options.get("fragment_sync_delay", 0)
        for t, (params, in_flight, sent) in enumerate(record, start=1):
            check.close(params, flat(expected[t - 1][group.rank]), f"{name}, step {t}: parameters vs the reference",
                        **tolerance)
            due = expected_flight(options, offsets, t)
            check.check(in_flight == due, f"{name}, step {t}: fragment {in_flight} in flight, expected {due}")
            formula = sum(launches_within(t, o, delay, options["sync_every"]) * n * element
                          for o, n in zip(offsets, sizes))
            check.equal(sent, formula, f"{name}, after step {t}: bytes_sent vs the formula")
        apart = max(np.abs(flat(workers[0]) - flat(workers[-1])).max() for workers in expected)
        check.check(group.size == 1 or apart > 0, f"{name}: the ranks never differed")


def check_repeatable_and_resumable(check, group):
    name, options, _, steps = CASES[1]
    runs = [train(*diloco(**options), 0, steps, group.rank, [])[-1][0] for _ in range(2)]
    check.equal(runs[1], runs[0], f"{name}: a second run, bit for bit")
    stop = 7  # fragment 0 was launched after step 7 and lands after step 8
    model, inner, method = diloco(**options)
    train(model, inner, method, 0, stop, group.rank)
    check.check(method.in_flight == 0, f"{name}: at the stop, fragment {method.in_flight} in flight, expected 0")
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "diloco": method.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=False)
    model, inner, method = diloco(**options)
    model.load_state_dict(state["model"])
    inner.load_state_dict(state["inner"])
    method.load_state_dict(state["diloco"])
    resumed = train(model, inner, method, stop, steps, group.rank, [])[-1][0]
    check.equal(resumed, runs[0], f"{name}: resumed after step {stop} vs uninterrupted, bit for bit")
    check.raises(ValueError, lambda: diloco(sync_every=6, fragments=2)[2].load_state_dict(state["diloco"]),
                 "loading a checkpoint of another configuration", match="was made with")


def check_one_outer_optimizer_per_fragment(check, group):
    """torchft's list of outer optimizers, one per fragment, is the single one over all, bit for bit."""
    options = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    single = train(*diloco(**options), 0, 9, group.rank, [])[-1][0]
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    parts = ddp.low_communication.split_parameters([p.numel() for p in model.parameters()], 2)
    params = list(model.parameters())
    outers = [torch.optim.SGD([params[i] for i in part], nesterov=True, **OUTER) for part in parts]
    method = ddp.DiLoCo(model, inner, outers, fragments=2, algorithm=ALGORITHM,
                        **{k: v for k, v in options.items() if k != "fragments"})
    check.equal(train(model, inner, method, 0, 9, group.rank, [])[-1][0], single,
                "one outer optimizer per fragment vs one for all")


def check_outer_sgd_lr_one_is_local_sgd(check, group):
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    method = ddp.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), sync_every=3)
    ours = train(model, inner, method, 0, 9, group.rank, [])
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), **INNER)
    averager = PeriodicModelAverager(period=3, warmup_steps=2)  # averages after steps 3, 6, 9 (its 0-based 2, 5, 8)
    for step in range(9):
        x, y = batch(step, group.rank)
        inner.zero_grad()
        F.mse_loss(model(x), y).backward()
        inner.step()
        averager.average_parameters(model.parameters())
        check.close(ours[step][0], flat(model.parameters()), f"outer SGD lr 1 vs local SGD, step {step + 1}", **TIGHT)


def check_after_ddp_warmup(check, group):
    options = {"sync_every": 3, "warmup_steps": 3}
    model, inner, method = diloco(wrap=lambda m: ddp.DistributedDataParallel(m, bucket_cap_mb=0.001), **options)
    check.check(model.reducer.comm_hook is post_localSGD_hook and method.ddp_hook_state is not None,
                "a DDP model without a comm hook gets the post-local SGD hook")
    record = train(model, inner, method, 0, 9, group.rank, [])
    expected = reference_run({"sync_every": 3}, [[0, 1, 2, 3, 4, 5]], 9, group.size, warmup=3)
    for t, (params, _, _) in enumerate(record, start=1):
        check.close(params, flat(expected[t - 1][group.rank]), f"DiLoCo after 3 DDP steps, step {t}", **TIGHT)
    check.equal(method.bytes_sent, 2 * 279 * 8, "DiLoCo after 3 DDP steps: bytes of its two rounds")
    check.equal(method.state_dict()["ddp_hook"]["iter"], 3, "the post-local SGD hook counted the warm-up (as torch's)")
    powersgd = ddp.DistributedDataParallel(mlp())
    powersgd.register_comm_hook(PowerSGDState(None, matrix_approximation_rank=1), powerSGD_hook)
    check.raises(ValueError, lambda: ddp.DiLoCo(powersgd, torch.optim.AdamW(powersgd.parameters()),
                                                torch.optim.SGD(powersgd.parameters(), lr=0.7), 3),
                 "a DDP model with another comm hook", match="inner steps must be local")
    user = ddp.DistributedDataParallel(mlp())
    user.register_comm_hook(PostLocalSGDState(None, None, 5, post_local_gradient_allreduce=False), post_localSGD_hook)
    check.raises(ValueError, lambda: ddp.DESLOC(user, torch.optim.Adam(user.parameters()), 2, warmup_steps=4),
                 "a post-local SGD hook starting elsewhere than warmup_steps", match="start_localSGD_iter=5")


def desloc(wrap=None, **options):
    model = mlp()
    model = wrap(model) if wrap else model
    adam = torch.optim.AdamW(model.parameters(), **INNER)
    return model, adam, ddp.DESLOC(model, adam, algorithm=ALGORITHM, **options)


def moments(adam, name):
    return flat([adam.state[p][name] for group in adam.param_groups for p in group["params"]])


def check_desloc(check, group):
    periods, steps = (2, 3, 6), 12
    model, adam, method = desloc(sync_every=periods)
    expected = reference.desloc(mlp(), batch, [steps] * group.size, periods=periods, adam=dict(INNER))
    for t in range(1, steps + 1):
        train(model, adam, method, t - 1, t, group.rank)  # the context entered again: the count goes on
        mine = expected[t - 1][group.rank]
        check.close(flat(model.parameters()), flat(mine["params"]), f"DES-LOC step {t}: parameters", **TIGHT)
        check.close(moments(adam, "exp_avg"), flat(mine["m"]), f"DES-LOC step {t}: exp_avg", **TIGHT)
        check.close(moments(adam, "exp_avg_sq"), flat(mine["v"]), f"DES-LOC step {t}: exp_avg_sq", **TIGHT)
        formula = 279 * 8 * sum(t // k for k in periods)
        check.equal(method.bytes_sent, formula, f"DES-LOC after step {t}: bytes_sent vs the formula")
    straight = flat(model.parameters())
    again = desloc(sync_every=periods)
    check.equal(train(*again, 0, steps, group.rank, [])[-1][0], straight, "DES-LOC: a second run, bit for bit")
    model, adam, method = desloc(sync_every=periods)
    train(model, adam, method, 0, 5, group.rank)
    state = {"model": model.state_dict(), "adam": adam.state_dict(), "desloc": method.state_dict()}
    model, adam, method = desloc(sync_every=periods)
    model.load_state_dict(state["model"])
    adam.load_state_dict(state["adam"])
    method.load_state_dict(state["desloc"])
    check.equal(train(model, adam, method, 5, steps, group.rank, [])[-1][0], straight,
                "DES-LOC resumed after step 5 vs uninterrupted, bit for bit")


def check_desloc_k1_against_ddp_adam(check, group):
    beta2 = INNER["betas"][1]
    same = lambda step, rank: batch(step, 0)  # noqa: E731 - every rank sees rank 0's data
    model, adam, method = desloc(sync_every=1)
    ours = train(model, adam, method, 0, 6, group.rank, [], data=same)
    net = ddp.DistributedDataParallel(mlp())
    theirs_adam = torch.optim.AdamW(net.parameters(), **INNER)
    for step in range(6):
        x, y = same(step, group.rank)
        theirs_adam.zero_grad()
        F.mse_loss(net(x), y).backward()
        theirs_adam.step()
        check.close(ours[step][0], flat(net.parameters()), f"DES-LOC K=1 vs DDP+AdamW, same data, step {step + 1}",
                    rtol=1e-9, atol=1e-12)
    # Different data, one step from the same start: per-rank gradients in closed form.
    model, adam, method = desloc(sync_every=1)
    train(model, adam, method, 0, 1, group.rank)
    start = mlp()
    x, y = batch(0, group.rank)
    F.mse_loss(start(x), y).backward()
    grads = np.empty((group.size, 279))
    group.allgather(grads, flat([p.grad for p in start.parameters()]))
    net = ddp.DistributedDataParallel(mlp())
    theirs_adam = torch.optim.AdamW(net.parameters(), **INNER)
    F.mse_loss(net(x), y).backward()
    theirs_adam.step()
    check.close(moments(adam, "exp_avg"), moments(theirs_adam, "exp_avg"), "K=1, step 1: exp_avg is DDP's", **TIGHT)
    variance = (grads ** 2).mean(0) - grads.mean(0) ** 2
    check.close(moments(adam, "exp_avg_sq") - moments(theirs_adam, "exp_avg_sq"), (1 - beta2) * variance,
                "K=1, step 1: exp_avg_sq exceeds DDP's by (1 - beta2) x the gradient variance", rtol=1e-8, atol=1e-18)
    # Adam's first step is lr * g / (|g| + eps) after the decay (the bias corrections cancel);
    # DES-LOC averages the ranks' steps.
    lr, eps = INNER["lr"], INNER["eps"]
    decayed = flat(mlp().parameters()) * (1 - lr * INNER["weight_decay"])
    closed_form = decayed - lr * (grads / (np.abs(grads) + eps)).mean(0)
    check.close(flat(model.parameters()), closed_form, "K=1, step 1: parameters, the averaged Adam steps", **TIGHT)
    differs = group.size > 1 and not np.allclose(flat(model.parameters()), flat(net.parameters()), rtol=1e-6)
    check.check(group.size == 1 or differs, "K=1 with different data: parameters equal DDP's, which the maths denies")


def check_join_uneven_inputs(check, group):
    steps_of = [9 - 2 * r for r in range(group.size)]  # 9, 7, 5, ...
    options = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
    model, inner, method = diloco(**options)
    with ddp.Join([method]):  # outside the method's context: a joined rank shadows without the hooks
        train(model, inner, method, 0, steps_of[group.rank], group.rank)
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    parts = [[index_of[id(p)] for p in fragment.params] for fragment in method.fragments]
    expected = reference_run(options, parts, max(steps_of), group.size, steps_of=steps_of)
    check.close(flat(model.parameters()), flat(expected[-1][group.rank]), "DiLoCo under Join: final parameters",
                **TIGHT)
    globals_ = torch.cat([t for f in method.fragments for t in f.global_flats]).numpy()
    everyone = np.empty((group.size, globals_.size))
    group.allgather(everyone, globals_)
    check.equal(everyone, np.broadcast_to(everyone[0], everyone.shape), "DiLoCo under Join: global parameters equal")
    # A DDP model first in the list: 2 steps of DDP (gradients divided by the initial world size), then DiLoCo.
    model, inner, method = diloco(wrap=lambda m: ddp.DistributedDataParallel(m, bucket_cap_mb=0.001), sync_every=3,
                                  warmup_steps=2)
    with ddp.Join([model, method]):
        train(model, inner, method, 0, steps_of[group.rank], group.rank)
    expected = reference_run({"sync_every": 3}, [[0, 1, 2, 3, 4, 5]], max(steps_of), group.size, steps_of=steps_of,
                             warmup=2)
    check.close(flat(model.parameters()), flat(expected[-1][group.rank]), "DDP + DiLoCo under Join: final parameters",
                **TIGHT)
    model, adam, method = desloc(sync_every=(2, 3, 6))
    with ddp.Join([method]):
        train(model, adam, method, 0, steps_of[group.rank], group.rank)
    expected = reference.desloc(mlp(), batch, steps_of, periods=(2, 3, 6), adam=dict(INNER))
    check.close(flat(model.parameters()), flat(expected[-1][group.rank]["params"]),
                "DES-LOC under Join: final parameters", **TIGHT)


def check_waits_are_counted(check, group):
    """``waited_seconds`` grows at the steps that wait for a synchronisation, and only there: with
    H = 2, after steps 2 and 4 (DiLoCo lands its average there; DES-LOC averages every quantity)."""
    methods = {"DiLoCo": diloco(sync_every=2), "DES-LOC": desloc(sync_every=(2, 2, 2))}
    for name, (model, optimizer, method) in methods.items():
        waited = []
        for t in range(1, 5):
            train(model, optimizer, method, t - 1, t, group.rank)
            waited.append(method.waited_seconds)
        check.check(waited[0] == 0.0 and waited[1] > 0 and waited[2] == waited[1] and waited[3] > waited[2],
                    f"{name}: waited_seconds after steps 1-4 {waited}: expected to grow at steps 2 and 4 only")


def check_bad_arguments(check, group):
    model = mlp()
    inner, outer = torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters(), lr=0.7)
    bad = [
        ("sync_every=0", lambda: ddp.DiLoCo(model, inner, outer, 0), "sync_every must be"),
        ("delay = gap", lambda: ddp.DiLoCo(model, inner, outer, 6, 3, fragment_sync_delay=2), "smaller than the 2"),
        ("alpha 1.5", lambda: ddp.DiLoCo(model, inner, outer, 6, fragment_update_alpha=1.5), "in [0, 1]"),
        ("7 fragments of 6", lambda: ddp.DiLoCo(model, inner, outer, 8, 7), "at most 6"),
        ("overlapping", lambda: ddp.DiLoCo(model, inner, outer, 6, [model, model[0]]), "must not overlap"),
        ("uncovered", lambda: ddp.DiLoCo(model, inner, outer, 6, [model[0]]), "in no fragment"),
        ("outer is inner", lambda: ddp.DiLoCo(model, inner, inner, 6), "the outer optimizer is the inner one"),
        ("outer misses", lambda: ddp.DiLoCo(model, inner, torch.optim.SGD(model[0].parameters(), lr=1), 6),
         "does not hold 4"),
        ("outer int8", lambda: ddp.DiLoCo(model, inner, outer, 6, outer_dtype=torch.int8), "outer_dtype"),
        ("DESLOC two periods", lambda: ddp.DESLOC(model, torch.optim.Adam(model.parameters()), (1, 2)), "(Kx, Ku, Kv)"),
        ("DESLOC period 0", lambda: ddp.DESLOC(model, torch.optim.Adam(model.parameters()), (1, 0, 2)), ">= 1"),
        ("DESLOC amsgrad", lambda: ddp.DESLOC(model, torch.optim.Adam(model.parameters(), amsgrad=True)), "amsgrad"),
    ]
    for what, build, match in bad:
        check.raises(ValueError, build, what, match=match)
    check.raises(TypeError, lambda: ddp.DESLOC(model, torch.optim.SGD(model.parameters(), lr=1)),
                 "DESLOC with SGD", match="AdamW")
    check.raises(TypeError, lambda: ddp.DiLoCo(model, inner, outer, 6, fragments="all"), "fragments as a str",
                 match="list of modules")


def check_hosts(check, group):
    if ALGORITHM == "hierarchical":
        hosts = len(set(host_of_each_rank(group)))
        check.check(hosts > 1, f"run with hierarchical on {hosts} host(s); expected several")
        chosen = group.resolve_algorithm("auto", 100 << 20, on_gpu=False, symmetric=False)
        check.check(chosen == "hierarchical", f"auto for a 100 MB pseudo-gradient across hosts is {chosen}")


def main():
    group = commlib.init()
    check = Checker()
    check_hosts(check, group)
    for fn in (check_bad_arguments, check_diloco_matches_reference, check_repeatable_and_resumable,
               check_one_outer_optimizer_per_fragment, check_outer_sgd_lr_one_is_local_sgd, check_after_ddp_warmup,
               check_desloc, check_desloc_k1_against_ddp_adam, check_join_uneven_inputs, check_waits_are_counted):
        fn(check, group)
    check.finish()


if __name__ == "__main__":
    main()
