"""The session's one mpiexec job per world size for the rank scripts that need torch.

Starting torch costs each rank more than most of the scripts' cases (about 1.2 s of CPU, and
the CI machine has two cores), so the scripts of test_torch.py, test_ordering.py,
test_efficient_dp.py, test_low_communication.py and test_ddp.py, and test_timeline.py's traced
training runs, share one start-up per world size: :data:`TORCH_JOB` is a shared
:class:`tests.support.mpirun.Job`, run by the first of those test files to need it at a world
size, whichever pytest worker runs it. Each script still has its own verdict. Every one of them
starts with the default ``commlib.init()`` (or ``autograd_bridge.init_process_group()``), as a
shared job requires.
"""

import os
import tempfile
from pathlib import Path

from tests.support.mpirun import ROOT, SHARED_JOBS_ENV, Job, Part

#: The traced training of test_timeline.py: train_digits.py, one epoch, batch 32 per rank.
TRACE_BATCH = 32


def trace_path(ranks: int) -> Path:
    """Where the job's traced training at ``ranks`` ranks writes its trace."""
    return Path(os.environ.get(SHARED_JOBS_ENV) or tempfile.gettempdir()) / f"train_digits-trace-{ranks}.json"


def traced_training(ranks: int) -> tuple:
    """The job's part that trains with a trace at ``ranks`` ranks: its script and arguments."""
    return (str(ROOT / "mpi_examples" / "train_digits.py"), "--epochs", "1", "--no-progress", "--batch-size",
            str(TRACE_BATCH), "--trace", str(trace_path(ranks)))


#: The world sizes of the default run. Only efficient_dp_local_sgd_ranks.py also runs at 4 (under
#: ``pytest -m full``); DDP's check at 4 ranks is its own job (test_ddp.py).
SIZES = (1, 2, 3)

TORCH_JOB = Job(
    Part("torch_collectives_ranks.py", sizes=SIZES), Part("torch_exchange_ranks.py", sizes=(2, 3)),
    Part("torch_ddp_ranks.py", sizes=(2, 3)), Part("torch_functional_ranks.py", sizes=SIZES),
    Part("torch_profiling_ranks.py", sizes=SIZES),
    Part("ordering_powersgd_ranks.py", sizes=(2, 3)), Part("ordering_callbacks_ranks.py", sizes=SIZES),
    Part("ordering_empty_ranks.py", sizes=(2, 3)),
    Part("efficient_dp_local_sgd_ranks.py", sizes=(2, 3, 4)), Part("efficient_dp_powersgd_ranks.py", sizes=(2, 3)),
    Part("efficient_dp_join_ranks.py", sizes=(2, 3)), Part("efficient_dp_resume_ranks.py", sizes=(2,)),
    Part("low_communication_ranks.py", sizes=SIZES),
    Part(*traced_training(2), sizes=(2,)), Part(*traced_training(3), sizes=(3,)),
    Part("ddp_equivalence_ranks.py", sizes=SIZES), Part("ddp_features_ranks.py", sizes=SIZES),
    # Last: it registers a failing allreduce algorithm for the rest of its process.
    Part("ddp_errors_ranks.py", sizes=SIZES),
    timeout=1500, shared="torch")
