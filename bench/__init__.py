"""Benchmarks of the data cache against what a user would do without it; see docs/benchmarks.md."""
