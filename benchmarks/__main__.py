"""``python -m benchmarks SUITE [flags]``: see ``benchmarks/cli.py``."""

import sys

from benchmarks.cli import build_parser, run_benchmark

if __name__ == "__main__":  # spawned rank / replica processes import this module again
    sys.exit(run_benchmark(build_parser().parse_args()))
