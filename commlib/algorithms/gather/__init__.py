"""gather's schedules: binomial."""
