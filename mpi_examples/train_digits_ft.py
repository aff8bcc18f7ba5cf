# python mpi_examples/train_digits_ft.py --coordinator HOST:PORT --id NAME [--steps 150]  (one per host, no mpiexec)
"""Train train_digits.py's CNN fault-tolerantly: one replica per host, averaging over the live ones.

Start ``python -m commlib.ft.coordinator --host HOST --port PORT --initial-replicas N`` once,
then this on every host with its own ``--id``. Kill a host's replica at any time (or cut its
network): the others go on within about a second (the heartbeat timeout); start it again with
the same command and it joins at the next step, taking the model, the optimizer and the data
position from a live peer. Every sample is trained once per pass across the membership changes;
the end prints the test accuracy, the replicas per committed step and the parameters' SHA-256
(the same on every replica). Three namespaced hosts: docs/fault-tolerance.md, "A whole job".
"""

import argparse
import hashlib
import sys

import torch
from torch import nn

from commlib.ft import Manager
from ddp import FaultTolerantDDP
from train_digits import digits_split  # the same data and test split as the MPI example


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coordinator", required=True, help="HOST:PORT of python -m commlib.ft.coordinator")
    p.add_argument("--id", required=True, help="this replica's name (the same when it is restarted)")
    p.add_argument("--steps", type=int, default=150, help="committed steps to train")
    p.add_argument("--batch-size", type=int, default=32, help="per replica and step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="a collective's deadline, seconds")
    p.add_argument("--events", help="write this replica's events here (python -m commlib.ft.timeline)")
    p.add_argument("--log-every", type=int, default=10, help="print one line every this many steps")
    return p.parse_args(argv)


def digits_net(seed):
    torch.manual_seed(seed)  # every replica starts from the same weights; a joiner gets the live ones anyway
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = digits_split()
    manager = Manager(args.coordinator, args.id, timeout=args.timeout)
    manager.configure_data(len(y_train), args.batch_size, args.seed)  # the data position travels with the state
    net = digits_net(args.seed)
    model = FaultTolerantDDP(net, manager)
    optimizer = manager.optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    while manager.steps < args.steps:
        optimizer.zero_grad()  # opens the step: joins a quorum first if this replica is not in one
        batch = torch.from_numpy(manager.batch_indices())  # this replica's share of the step
        loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
        loss.backward()
        if optimizer.step() and manager.steps % args.log_every == 0:  # applied only if the step committed
            print(f"{args.id}: step {manager.steps} with {len(manager.members)} replicas, loss {loss.item():.4f}",
                  flush=True)
    with torch.no_grad():
        accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
    summary = manager.summary()
    runs: list = []  # replicas per step, run-length encoded: "3x40 2x12 3x98"
    for count in summary["members_per_step"]:
        if runs and runs[-1][0] == count:
            runs[-1][1] += 1
        else:
            runs.append([count, 1])
    print(f"{args.id}: {summary['steps']} steps, test accuracy {100 * accuracy:.2f}%; replicas per step "
          f"{' '.join(f'{count}x{length}' for count, length in runs)}; samples per pass "
          f"{summary['samples_per_data_epoch']}, dropped {summary['dropped_per_data_epoch']}; "
          f"parameters sha256 {digest}", flush=True)
    if args.events:
        manager.save_events(args.events)
    manager.close()


if __name__ == "__main__":
    sys.exit(main())
