"""One replica of a fault-tolerant training run (started by tests/ft/test_fault_tolerance.py).

    python tests/ft/fault_tolerance_ranks.py --coordinator 127.0.0.1:29600 --id r0 --steps 20 --out r0.pt

It trains :func:`tests.support.ft_training.build` on its share of each step, ``--die-at STEP:POINT``
SIGKILLs itself when it reaches that step (POINT: ``forward`` before its forward pass,
``allreduce`` once its allreduce is done but before it votes, ``catchup`` once it has sent
chunk ``--die-chunk`` (from 0; default 1) of its state to a joiner; STEP ``*``: any step), and it writes its final
parameters, ledger and events to ``--out``. ``--ballast-mib N`` adds N MiB to the state a
joiner takes (every replica of a run must give the same N), so that a catch-up has chunks.
``--diloco H`` trains with :class:`ddp.FaultTolerantDiLoCo` instead (a step is a round of H
inner steps); ``--torch-ddp`` with torch's DDP and :func:`ddp.manager_comm_hook` (or only the
replicas named by ``--torch-ddp-replicas``), and the replicas named by ``--our-ddp-replicas``
with our DDP and that hook (:func:`ddp.fault_tolerant_ddp`). ``--batch-size``: samples per replica
per step (default ``ft_training.BATCH_SIZE``).
``--probe-every N --slow-below BYTES_PER_S --slow-ratio R`` turns on the search for a slow
member (:class:`commlib.ft.SlowReplicas`): a link probe every N steps and when an epoch starts.
``--local`` (under ``mpiexec -n L``): the replica is the job's L ranks, data parallel inside
(``Manager(local_group=...)``, each rank trains on its part of the replica's share; torch's DDP
over the "commlib" backend's default group, which is the job's ranks); local rank
0 writes ``--out``, the others ``--out`` with ``.rank<j>.pt``; only local rank 0 dies at ``--die-at``
(the job then ends, as mpiexec ends a job one of whose ranks was killed).
``--own-data``: no sample accounting (no ``configure_data``); each rank trains on
:func:`tests.support.ft_training.own_batch` of the step, its replica's rank in the quorum and its local rank.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch

from commlib import InvalidUsageError
from commlib.ft import Manager, SlowReplicas, keys
from ddp import FaultTolerantDDP, FaultTolerantDiLoCo, fault_tolerant_ddp, fault_tolerant_torch_ddp
from tests.support import ft_training


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--die-at", default="")
    parser.add_argument("--die-chunk", type=int, default=1, help="with --die-at STEP:catchup: after this chunk")
    parser.add_argument("--ballast-mib", type=int, default=0)
    parser.add_argument("--diloco", type=int, default=0, metavar="H")
    parser.add_argument("--torch-ddp", action="store_true", help="torch's DDP with ddp.manager_comm_hook")
    parser.add_argument("--torch-ddp-replicas", default="", metavar="ID,ID",
                        help="these replicas train with torch's DDP and ddp.manager_comm_hook")
    parser.add_argument("--batch-size", type=int, default=ft_training.BATCH_SIZE)
    parser.add_argument("--our-ddp-replicas", default="", metavar="ID,ID",
                        help="these replicas train with our DDP and the same hook (ddp.fault_tolerant_ddp)")
    parser.add_argument("--probe-every", type=int, default=0)
    parser.add_argument("--slow-below", type=float, default=None)
    parser.add_argument("--slow-ratio", type=float, default=0.1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--local", action="store_true", help="the replica is this mpiexec job's ranks")
    parser.add_argument("--own-data", action="store_true", help="no configure_data: ft_training.own_batch")
    parser.add_argument("--progress", default="")
    parser.add_argument("--ready", default="", help="a file written once the replica is heartbeating")
    parser.add_argument("--hold", action="append", default=[], metavar="STEP:FILE",
                        help="before step STEP, wait until FILE exists and the epoch closed (repeatable)")
    parser.add_argument("--pause", action="append", default=[], metavar="STEP:FILE",
                        help="before step STEP, wait until FILE exists (repeatable)")
    args = parser.parse_args()
    if args.own_data and args.diloco:
        parser.error("--own-data trains plain steps only (not with --diloco)")
    torch.set_num_threads(1)
    die_step, _, die_point = args.die_at.partition(":")
    die_step = die_step if die_step == "*" else int(die_step) if die_step else -1

    local = None
    if args.local:
        import commlib

        local = commlib.init(timeout=60)
    leader = local is None or local.rank == 0

    def maybe_die(point: str) -> None:
        if die_step in ("*", manager.steps) and point == die_point and leader:
            print(f"{args.id}: SIGKILL at step {manager.steps} ({point})", flush=True)
            if args.ready:
                with open(args.ready.replace(".ready", ".died"), "w") as handle:
                    handle.write(repr(time.time()))
                with open(args.ready.replace(".ready", ".died-step"), "w") as handle:
                    handle.write(str(manager.steps))
            os.kill(os.getpid(), signal.SIGKILL)

    slow = None
    if args.probe_every:
        slow = SlowReplicas(every=args.probe_every, below=args.slow_below, ratio=args.slow_ratio)
    manager = Manager(args.coordinator, args.id, timeout=30.0, heartbeat_interval=0.1, slow_replicas=slow,
                      local_group=local)
    if args.ready and leader:
        open(args.ready, "w").close()
    rounds = max(1, args.diloco)  # a DiLoCo step takes a round's samples: H inner batches
    if not args.own_data:
        manager.configure_data(ft_training.DATASET_SIZE, args.batch_size * rounds, ft_training.SEED)
    net, inputs, targets = ft_training.build()
    if args.diloco:
        inner = ft_training.inner_optimizer(net.parameters())
        diloco = FaultTolerantDiLoCo(net, manager, inner, ft_training.outer_optimizer(net.parameters()),
                                     sync_every=args.diloco)
    else:
        torch_ddp = args.torch_ddp or args.id in args.torch_ddp_replicas.split(",")
        if args.id in args.our_ddp_replicas.split(","):
            if local is not None:
                check_our_ddp_needs_the_replicas_ranks(manager, local)
            model = fault_tolerant_ddp(net, manager)
        elif torch_ddp:
            if local is not None:
                check_torch_ddp_needs_the_replicas_group(manager, local.size)
                import autograd_bridge.backend

                autograd_bridge.backend.init_process_group()  # torch's default group: this job's ranks
            model = fault_tolerant_torch_ddp(net, manager)
        else:
            model = FaultTolerantDDP(net, manager)
        optimizer = manager.optimizer(ft_training.optimizer(model.parameters()))
    if die_point == "allreduce":
        manager.gradient_hooks.append(lambda: maybe_die("allreduce"))
    if die_point == "catchup":
        manager.catch_up_hooks.append(lambda index: maybe_die("catchup") if index == args.die_chunk else None)
    if args.ballast_mib:
        ballast = {"bytes": torch.zeros(args.ballast_mib << 20, dtype=torch.uint8)}
        manager.register_state("ballast", lambda: ballast["bytes"], lambda loaded: ballast.update(bytes=loaded))
    shown = 0
    while manager.steps < args.steps:
        for hold in args.hold:
            step, _, gate = hold.partition(":")
            # A hold ends once its gate exists and this replica's heartbeat has seen the epoch
            # close that the gate announces (a joiner, a restarted coordinator): the next step is
            # then this epoch's last, however fast the steps are.
            while manager.steps == int(step) and not (
                    os.path.exists(gate) and manager.heartbeat.watched(keys.closed(manager.epoch))):
                time.sleep(0.01)
        for pause in args.pause:
            step, _, gate = pause.partition(":")
            while manager.steps == int(step) and not os.path.exists(gate):
                time.sleep(0.01)
        if args.diloco:
            chunks = diloco.round()
            for position, chunk in enumerate(chunks):
                if position == len(chunks) // 2:
                    maybe_die("forward")  # in the middle of the round's inner steps
                inner.zero_grad()
                batch = torch.from_numpy(chunk)
                if len(batch):  # (a rank's part of an inner batch may be empty: it steps all the same)
                    ft_training.loss(net(inputs[batch]), targets[batch]).backward()
                inner.step()
            diloco.sync()
        else:
            optimizer.zero_grad()
            if args.own_data:
                own = ft_training.own_batch(manager.steps, manager.rank, local.rank if local is not None else 0)
                indices = torch.from_numpy(own)
            else:
                indices = torch.from_numpy(manager.local_batch_indices())
            maybe_die("forward")
            output = model(inputs[indices])
            # A rank's part of its replica's share may be empty: its gradient is zeros, and it
            # runs backward all the same (the DDP hooks average over the replica from there).
            loss = ft_training.loss(output, targets[indices]) if len(indices) else output.sum()
            loss.backward()
            optimizer.step()
        verbose = os.environ.get("FT_VERBOSE")
        for event in manager.events[shown:]:  # every event with FT_VERBOSE, the probes always
            if verbose or event["kind"].startswith("probe"):
                print(f"{args.id}: {time.time() - event['t']:.3f} s ago: {event}", flush=True)
        shown = len(manager.events)
        if args.progress and leader:
            with open(args.progress, "w") as handle:
                handle.write(str(manager.steps))
    if args.diloco and local is not None:
        check_diloco_counts_the_inner_steps(inner)
    out = args.out if leader else args.out.replace(".pt", f".rank{local.rank}.pt")
    manager.save_events(out.replace(".pt", ".events.json"))
    torch.save({"params": [p.detach().clone() for p in net.parameters()], "ledger": manager.ledger.to_json(),
                "events": manager.events, "summary": manager.summary()}, out)
    print(f"{args.id}: done at step {manager.steps}: {json.dumps(manager.summary()['members_per_step'])}",
          flush=True)
    started = time.monotonic()
    manager.close()
    if os.environ.get("FT_VERBOSE"):
        print(f"{args.id}: closed in {time.monotonic() - started:.2f} s", flush=True)
    sys.exit(0)


def check_torch_ddp_needs_the_replicas_group(manager: Manager, ranks: int) -> None:
    """Before torch.distributed is initialized, torch's DDP on a replica of several ranks is
    refused by name (its one-rank default group would leave the replica's other ranks out)."""
    try:
        fault_tolerant_torch_ddp(ft_training.build()[0], manager)
    except InvalidUsageError as error:
        assert f"the replica has {ranks} ranks and torch.distributed is not initialized" in str(error), error
    else:
        raise AssertionError("fault_tolerant_torch_ddp made a group of one rank for a replica of several")


def check_diloco_counts_the_inner_steps(inner) -> None:
    """On a replica of several ranks an inner step outside a round is refused by name before it
    averages anything (the replica's ranks would otherwise wait on each other's extra step)."""
    try:
        inner.step()
    except InvalidUsageError as error:
        assert "FaultTolerantDiLoCo: inner.step() outside a round on a replica of 2 ranks" in str(error), error
    else:
        raise AssertionError("an inner step outside a round was taken")


def check_our_ddp_needs_the_replicas_ranks(manager: Manager, local) -> None:
    """Our DDP over a group that is not the replica's ranks (here: local rank 0 alone) is refused
    by name, and registers nothing for catch-up."""
    alone = local.new_group([0])  # collective: every rank of the replica calls it
    if alone is None:
        return
    registered = dict(manager.states)
    try:
        fault_tolerant_ddp(ft_training.build()[0], manager, process_group=alone)
    except InvalidUsageError as error:
        assert f"the DDP's group has 1 rank but the replica has {local.size}" in str(error), error
    else:
        raise AssertionError("fault_tolerant_ddp took a group of one rank of a replica of several")
    assert manager.states == registered, "a refused DDP registered its model for catch-up"
    alone.close()


if __name__ == "__main__":
    main()
