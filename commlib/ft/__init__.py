"""Fault-tolerant data parallelism: replicas that keep training when one dies, and let it back in.

    python -m commlib.ft.coordinator --port 29600 --open          # once per job, its own process

    manager = commlib.ft.Manager("coordinator-host:29600", replica_id="host-a")
    model = ddp.FaultTolerantDDP(net, manager)
    opt = manager.optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    # the training loop as before: opt.zero_grad(); loss.backward(); opt.step()

:mod:`.coordinator` decides quorums over our TCP store (not imported here: it runs with
``-m``); :mod:`.manager` is a replica's side of the
protocol (steps commit or are discarded everywhere); :mod:`.catchup` moves state to a joiner;
:mod:`.sampling` assigns samples and keeps the ledger; :mod:`.links` finds a slow member;
:mod:`.keys` is the store's layout.
See docs/fault-tolerance.md.
"""

from commlib.ft.catchup import CatchUp
from commlib.ft.links import SlowReplicas
from commlib.ft.manager import Manager, finish_average
from commlib.ft.optimizer import OptimizerWrapper
from commlib.ft.sampling import Ledger, StepRecord

__all__ = ["Manager", "OptimizerWrapper", "CatchUp", "Ledger", "StepRecord", "SlowReplicas", "finish_average"]
