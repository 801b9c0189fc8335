"""Benchmarks, run through ``ngrammar bench``; results go to BENCHMARKS.md."""
