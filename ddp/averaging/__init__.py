"""Model averaging for local SGD (torch's ``torch.distributed.algorithms.model_averaging``).

* :func:`average_parameters`, :func:`get_params_to_average`,
  :func:`average_parameters_or_parameter_groups` (:mod:`.utils`);
* :class:`PeriodicModelAverager` (:mod:`.averagers`): everything every ``period`` steps;
* :class:`HierarchicalModelAverager` (:mod:`.hierarchical`): small groups often, all rarely;
* :class:`PartialModelAverager` (:mod:`.partial`): 1/period of the model every step, overlapped
  with the next step (DreamDDP's partial synchronisation); :func:`plan_partial_sync` its plan.

All are :class:`ddp.Joinable`, count their bytes (``bytes_sent``) and have ``state_dict()``.
"""

from ddp.averaging.averagers import ModelAverager, PeriodicModelAverager
from ddp.averaging.hierarchical import HierarchicalModelAverager
from ddp.averaging.partial import PartialModelAverager
from ddp.averaging.schedule import Piece, plan_partial_sync
from ddp.averaging.utils import average_parameters, average_parameters_or_parameter_groups, get_params_to_average

__all__ = ["ModelAverager", "PeriodicModelAverager", "HierarchicalModelAverager", "PartialModelAverager",
           "average_parameters", "average_parameters_or_parameter_groups", "get_params_to_average",
           "plan_partial_sync", "Piece"]
