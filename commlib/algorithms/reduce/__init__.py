"""reduce's schedules: binomial, Rabenseifner."""
