"""`areal-metrics compare GROUP_A GROUP_B [--dataset D] [--stage full] [--step S] [--json]` (areal_metrics.analysis.comparison)."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("group_a", metavar="GROUP_A", help="a group of runs (the `group` given to areal_metrics.init)")
    parser.add_argument("group_b", metavar="GROUP_B", help="the group to compare it with")
    parser.add_argument("--dataset", help="the evaluation dataset (needed when the groups share several)")
    parser.add_argument("--stage", choices=("quick", "full"), default="full", help="the stage compared (default: full)")
    parser.add_argument("--step", type=int, help="compare every run's consensus at this step (default: the last "
                        "step at which every run of both groups evaluated)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    from areal_metrics.analysis.comparison import compare, render
    from areal_metrics.sinks.query import connect

    with connect() as store:  # StoreUnavailable (exit 1) or a bad URL's ConfigError (exit 2), said by the CLI
        result = compare(store, args.group_a, args.group_b, args.dataset, args.stage, args.step)
    sys.stdout.write(json.dumps(result) + "\n" if args.json else render(result))
    return 0
