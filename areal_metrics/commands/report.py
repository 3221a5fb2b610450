"""`areal-metrics report --out DIR [--run ID ...]`: the report figures as PNG, from ClickHouse."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--out", type=Path, default=Path("reports"), help="directory for the PNGs (default: reports)")
    parser.add_argument("--run", action="append", dest="runs", default=None, metavar="ID",
                        help="a run to include (repeat for several; default: every run stored)")
    parser.add_argument("--eval-details", action="store_true",
                        help="figure 1 also draws pass@k, maj@k and greedy accuracy of each round's consensus")


def run(args: argparse.Namespace) -> int:
    from areal_metrics.report import write_report

    for path in write_report(args.out, args.runs, eval_details=args.eval_details):
        print(path)
    return 0
