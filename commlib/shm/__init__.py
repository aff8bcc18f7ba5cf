"""Shared memory among the ranks of one host: the segments (one file per rank, mapped by every
rank of the host), the symmetric heap laid out in them, and cross-memory attach (single copies
between processes).

Below the transports: the shared-memory transport and the progress board map their memory here.
"""
