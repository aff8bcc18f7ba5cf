"""broadcast's schedules: binomial, chain, flat, scatter-allgather."""
