"""`python -m cluster.loadgen --url URL ...`: the same as `radixray bench ...`."""

import argparse
import sys

from cluster.loadgen.cli import add_bench_args, run_bench


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.loadgen")
    add_bench_args(parser)
    return run_bench(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
