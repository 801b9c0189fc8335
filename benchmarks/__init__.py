"""Benchmarks, run through ``python -m benchmarks``; results go to BENCHMARKS.md."""
