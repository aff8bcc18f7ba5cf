"""PYTHONPATH=. mpiexec -n 4 python tests/mpi/torch_stack_ranks.py --checkpoints D --save-for-resharding
PYTHONPATH=. mpiexec -n 2 python tests/mpi/torch_stack_ranks.py --checkpoints D --load-resharded --without-ml-dtypes

torch's modern stack on the "commlib" backend, each result held against gloo's, bit for bit.

(the repo root on PYTHONPATH, as ``tests.support.mpirun.run_mpi`` sets it). One job runs every
check of :mod:`tests.mpi.torch_stack` (a torch import costs seconds per rank): groups and
DeviceMesh, DTensor and tensor parallelism, FSDP2 (HSDP on a 2x2 mesh at P=4),
ZeroRedundancyOptimizer, distributed checkpoint (commlib's files loaded on gloo and the reverse;
written at P=4 and loaded resharded at P=2), sparse allreduce and DDP with sparse embeddings,
bfloat16, PREMUL_SUM, bool and coalesced reductions, the futures of small async calls, and the
inputs the backend must refuse. ``--without-ml-dtypes`` makes ``import
ml_dtypes`` fail before anything is imported, as for a torch user without it.
"""

import argparse
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", required=True, help="a directory shared by the ranks")
    parser.add_argument("--save-for-resharding", action="store_true")
    parser.add_argument("--load-resharded", action="store_true")
    parser.add_argument("--without-ml-dtypes", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated check names (default: all)")
    args = parser.parse_args()
    if args.without_ml_dtypes:
        sys.modules["ml_dtypes"] = None  # type: ignore[assignment]  # makes `import ml_dtypes` raise

    import torch
    import torch.distributed as dist

    import autograd_bridge
    from tests.mpi.torch_stack import checks
    from tests.support.verdict import Checker

    torch.set_num_threads(1)
    autograd_bridge.init_process_group()
    checker = Checker()
    if args.without_ml_dtypes:
        checker.check("ml_dtypes" not in sys.modules or sys.modules["ml_dtypes"] is None,
                      "ml_dtypes was imported although it was blocked")
    only = set(filter(None, args.only.split(",")))
    for name, check in checks.ALL.items():
        if not only or name in only:
            check(checker, args)
            dist.barrier()
    dist.destroy_process_group()
    checker.finish()


if __name__ == "__main__":
    main()
