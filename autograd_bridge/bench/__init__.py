"""Benchmarks of torch.distributed over "commlib" against gloo, both measured in the same job.

    mpiexec -n 2 python -m autograd_bridge.bench [--json out.json]        # allreduce latency, torch DDP step
    mpiexec -n 2 python -m autograd_bridge.bench.stack [--json out.json]  # FSDP2 step, DTensor, sparse allreduce

Each prints tables (medians, the ratio to gloo); ``--json`` writes them in the project's one
format (:mod:`.record`). The timing functions take any torch process group, for other scripts.
"""

from autograd_bridge.bench.allreduce_ddp import MLP_WIDTHS, SIZES, allreduce_latency, ddp_step_times, make_mlp

__all__ = ["MLP_WIDTHS", "SIZES", "allreduce_latency", "ddp_step_times", "make_mlp"]
