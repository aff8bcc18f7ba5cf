"""The checks ``torch_stack_ranks.py`` runs, in order: name -> ``check(checker, args)``."""

from tests.mpi.torch_stack.bad_input import check_bad_input
from tests.mpi.torch_stack.bf16 import check_bf16
from tests.mpi.torch_stack.checkpoint import check_checkpoint
from tests.mpi.torch_stack.dtensor import check_dtensor
from tests.mpi.torch_stack.fsdp import check_fsdp
from tests.mpi.torch_stack.futures import check_eager_futures
from tests.mpi.torch_stack.groups import check_groups
from tests.mpi.torch_stack.reductions import check_reductions
from tests.mpi.torch_stack.sparse import check_sparse

ALL = {
    "groups": lambda checker, args: check_groups(checker),
    "dtensor": lambda checker, args: check_dtensor(checker),
    "fsdp": lambda checker, args: check_fsdp(checker),
    "checkpoint": check_checkpoint,
    "sparse": lambda checker, args: check_sparse(checker),
    "bf16": lambda checker, args: check_bf16(checker),
    "reductions": lambda checker, args: check_reductions(checker),
    "bad_input": lambda checker, args: check_bad_input(checker),
    "futures": lambda checker, args: check_eager_futures(checker),
}
