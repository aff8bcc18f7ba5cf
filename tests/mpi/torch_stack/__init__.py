"""Checks of torch's modern stack on the "commlib" backend, run by ``tests/mpi/torch_stack_ranks.py``."""
