"""An alpha-beta-gamma cost model of the allreduce algorithms across hosts: fit, predict, DDP scaling.

::

    mpiexec -n P python -m commlib.costmodel fit --out model.json       # measure this job's links
    python -m commlib.costmodel predict --model model.json --hosts 4 --ranks-per-host 8 --bytes 64M
    python -m commlib.costmodel ddp --model model.json --trace trace.json --hosts 1,2,4,8 --ranks-per-host 8
    python -m commlib.costmodel validate --model model.json --bench rows.json   # against measurements

``COMMLIB_COST_MODEL=model.json`` makes ``algorithm="auto"`` pick, for groups that span hosts,
the algorithm the model predicts fastest. The model itself lives below the group, in
:mod:`commlib.selection` (:mod:`~commlib.selection.formulas`, the closed forms;
:mod:`~commlib.selection.cost_model`, the JSON and choices); this package is the tool around
it: :mod:`.fit` (the measurements), :mod:`.ddp_scaling` (a DDP trace replayed at more ranks),
:mod:`.__main__` (the command line).
"""

from commlib.selection import formulas
from commlib.selection.cost_model import FORMAT, CostModel
from commlib.selection.formulas import FORMULAS, Breakdown, Links, predict

__all__ = ["CostModel", "Links", "Breakdown", "FORMULAS", "FORMAT", "predict", "formulas"]
