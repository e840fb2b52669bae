"""`python -m cluster.sim ...`: the same as `radixray simulate ...`."""

import argparse
import sys

from cluster.sim.cli import add_simulate_args, run_simulate


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m cluster.sim", description=__doc__)
    add_simulate_args(parser)
    return run_simulate(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
