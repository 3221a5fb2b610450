"""`areal-metrics VERB ...`: one module per verb under areal_metrics.commands.

Each verb module has `add_arguments(parser, verb)` and `run(args) -> int`, and
imports heavy libraries (torch, faust, chdb) inside `run`, so that `status`,
`--version` or a bad argument answers at once.

Exit status: 0 success; 2 bad input (`UserError`, a usage error, an invalid
event); 1 a service that cannot be reached or an event that was not delivered
(`ServiceUnavailable`). Every error is one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from types import ModuleType
from typing import NoReturn

from areal_metrics.producers.contract.errors import ArealError, one_line
from areal_metrics.producers.contract.events import ValidationError

from areal_metrics.commands import alerts, demo, grafana, publish, replay, report, sql, stack_cmd, sync, train, watch

# verb -> (module, one-line help); a module may serve several verbs
VERBS: dict[str, tuple[ModuleType, str]] = {
    "up": (stack_cmd, "start the local stack (Kafka broker, stream worker, sink)"),
    "down": (stack_cmd, "stop the local stack"),
    "status": (stack_cmd, "report the local stack; exit 0 when running, 1 when not"),
    "demo": (demo, "the main job: stack + distributed PPO training + live view + report"),
    "train": (train, "run the distributed PPO trainer, publishing to Kafka"),
    "watch": (watch, "live terminal view of running runs"),
    "alerts": (alerts, "print alerts as JSON lines (--follow keeps subscribing)"),
    "sql": (sql, "run ad hoc SQL against the configured ClickHouse"),
    "report": (report, "write the report figures as PNG"),
    "grafana": (grafana, "grafana provision: push the datasource and dashboards"),
    "replay": (replay, "rebuild the ClickHouse tables from the Kafka log"),
    "publish": (publish, "validate JSON events from a file or stdin and publish them; exit 1 if not delivered"),
    "sync": (sync, "send the events your runs kept in their journals while the broker was away"),
}


def version() -> str:
    import areal_metrics

    return areal_metrics.__version__


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="areal-metrics", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"areal-metrics {version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=OneLineParser)
    sub.required = True
    for verb, (module, help_text) in VERBS.items():
        verb_parser = sub.add_parser(verb, help=help_text, description=help_text)
        module.add_arguments(verb_parser, verb)
        verb_parser.set_defaults(run=module.run)
    return parser


def use_local_stack_bootstrap() -> None:
    """Point this process and its children at the broker of the local stack.

    The ground package never reads the stack's files: the CLI passes the
    bootstrap in, through the environment its children (trainers, services) inherit.
    """
    from areal_metrics.stack.services import read_info

    if os.environ.get("AREAL_KAFKA_BOOTSTRAP"):
        return
    info = read_info()
    if info is not None and info.kafka_bootstrap:
        os.environ["AREAL_KAFKA_BOOTSTRAP"] = info.kafka_bootstrap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    use_local_stack_bootstrap()
    try:
        return int(args.run(args) or 0)
    except ValidationError as exc:
        print(f"areal-metrics {args.verb}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except ArealError as exc:
        print(f"areal-metrics {args.verb}: error: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
