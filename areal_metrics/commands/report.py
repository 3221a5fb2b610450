"""`areal-metrics report --out DIR [--run ID ...] [--metric KEY ...] [--group]`: the report figures as PNG."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--out", type=Path, default=Path("reports"), help="directory for the PNGs (default: reports)")
    parser.add_argument("--run", action="append", dest="runs", default=None, metavar="ID",
                        help="a run to include (repeat for several; default: every run stored)")
    parser.add_argument("--metric", action="append", dest="metrics", default=[], metavar="KEY",
                        help="also draw this logged value per run, e.g. kl or actor/pg_loss (repeatable)")
    parser.add_argument("--group", action="store_true",
                        help="average the runs of each group (mean and 95 %% t-interval band) instead of one line per run")
    parser.add_argument("--eval-details", action="store_true",
                        help="figure 1 also draws pass@k, maj@k and greedy accuracy of each round's consensus")


def run(args: argparse.Namespace) -> int:
    from areal_metrics.analysis.report import write_report

    for path in write_report(args.out, args.runs, metrics=args.metrics, grouped=args.group,
                             eval_details=args.eval_details):
        print(path)
    return 0
