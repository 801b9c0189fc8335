"""``python -m benchmarks SUITE [flags]``: see ``benchmarks/cli.py``."""

import sys

from benchmarks.cli import build_parser, run_benchmark

sys.exit(run_benchmark(build_parser().parse_args()))
