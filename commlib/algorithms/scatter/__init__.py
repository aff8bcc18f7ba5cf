"""scatter's schedules: binomial."""
