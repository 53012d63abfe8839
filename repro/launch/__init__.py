"""Slurm launch helpers: the job scripts' table, config checks before launch, submit/sweep/status."""
