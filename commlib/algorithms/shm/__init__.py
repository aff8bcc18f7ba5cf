"""Schedules that read and write the peers' memory on one host: ``shm_oneshot`` and
``shm_twoshot`` (allreduce), ``shm_direct`` (broadcast, allgather, gather, scatter, alltoall).
They run on the shared-memory transport only (``requires_shared_memory``)."""
