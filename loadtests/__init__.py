"""Benchmarks and load tests: they measure, they do not assert."""
