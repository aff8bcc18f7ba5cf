"""One replica of several ranks (started by tests/ft/test_replica_groups.py under its own mpiexec).

    mpiexec -n 2 python tests/ft/replica_group_ranks.py --coordinator 127.0.0.1:29600 --id r0 --steps 12 --out D

The replica trains a linear model split by features across its ranks, as tensor parallelism
splits a layer: local rank ``j`` holds the weights of feature block ``j`` and computes its part
of each prediction, the parts are summed over the replica's own group (MPI), and each rank
averages its block's gradient with local rank ``j`` of the other replicas
(``commlib.ft.Manager(local_group=...)``). So a rank that caught up from the wrong peer, or
ranks of one replica that applied different steps, end with weights no replay gives. Numpy
only (no torch start-up). Each rank writes ``D/<id>.<j>.json``: its weights (hex of the bytes),
its ledger and the kinds of its manager's events; ``D/<id>.progress`` (local rank 0's) holds the committed step count
after each step. ``--hold STEP:FILE``: before step STEP, wait until FILE exists and the epoch
closed; ``--pause STEP:FILE``: until FILE exists.
"""

import argparse
import json
import os
import time

import numpy as np

import commlib
from commlib import InvalidUsageError
from commlib.ft import Manager, SlowReplicas, keys
from tests.support.ft_sharded import BATCH_SIZE, DATASET_SIZE, SEED, Sharded


class Codec:
    """The state is one float64 vector (this rank's weights)."""

    @staticmethod
    def encode(objects) -> memoryview:
        return memoryview(objects["weights"]).cast("B")

    @staticmethod
    def decode(data) -> dict:
        return {"weights": np.frombuffer(data, np.float64).copy()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--id", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold", action="append", default=[], metavar="STEP:FILE",
                        help="before step STEP, wait until FILE exists and the epoch closed (repeatable)")
    parser.add_argument("--pause", action="append", default=[], metavar="STEP:FILE",
                        help="before step STEP, wait until FILE exists (repeatable)")
    args = parser.parse_args()
    local = commlib.init(timeout=60)
    model = Sharded(local.rank, local.size)
    try:  # the link probe measures replicas of one rank: refused, by name, before anything connects
        Manager(args.coordinator, args.id, local_group=local, slow_replicas=SlowReplicas(every=2))
    except InvalidUsageError as error:
        assert f"slow_replicas with a local_group of {local.size} ranks" in str(error), error
    else:
        raise AssertionError("a Manager took slow_replicas with a local group")
    manager = Manager(args.coordinator, args.id, timeout=30, local_group=local)
    manager.codec = Codec()
    manager.configure_data(DATASET_SIZE, BATCH_SIZE, SEED)

    def load(weights) -> None:
        model.weights[...] = weights

    manager.register_state("weights", lambda: model.weights, load)
    progress = os.path.join(args.out, f"{args.id}.progress")
    holds = {int(step): path for step, _, path in (hold.partition(":") for hold in args.hold)}
    pauses = {int(step): path for step, _, path in (pause.partition(":") for pause in args.pause)}
    while manager.steps < args.steps:
        if manager.steps in holds:
            # A hold ends once its gate exists and this rank's watcher has seen the epoch close
            # (the lost replica, the joiner): the next step is then this epoch's last, however
            # fast the steps are.
            gate = holds.pop(manager.steps)
            while not (os.path.exists(gate) and manager.heartbeat.watched(keys.closed(manager.epoch))):
                time.sleep(0.01)
        if manager.steps in pauses:
            gate = pauses.pop(manager.steps)
            while not os.path.exists(gate):
                time.sleep(0.01)
        manager.start_step()
        indices = manager.batch_indices()
        part = model.partial_prediction(indices)
        local.allreduce(part)  # the replica's own group: the prediction from every feature block
        gradient = model.gradient(indices, part)
        manager.allreduce_average(gradient, manager.gradient_weight())
        if manager.should_commit():
            model.apply(gradient)
        if local.rank == 0:
            with open(progress + ".tmp", "w") as handle:
                handle.write(str(manager.steps))
            os.replace(progress + ".tmp", progress)
    result = {"weights": model.weights.tobytes().hex(), "ledger": manager.ledger.to_json(),
              "events": [event["kind"] for event in manager.events]}
    with open(os.path.join(args.out, f"{args.id}.{local.rank}.json"), "w") as handle:
        json.dump(result, handle)
    manager.close()
    print(f"{args.id}.{local.rank}: {manager.steps} steps, members per step "
          f"{[len(record.members) for record in manager.ledger.steps]}", flush=True)


if __name__ == "__main__":
    main()
