"""Transports: how bytes move between ranks (MPI on CPU; NCCL and host-staged on GPU)."""
