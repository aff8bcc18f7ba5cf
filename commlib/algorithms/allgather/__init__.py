"""allgather's schedules: ring, recursive doubling, Bruck."""
