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
import logging
import os
import sys
from types import ModuleType
from typing import NoReturn

from areal_metrics import extras
from areal_metrics.producers.contract.errors import ArealError, one_line

from areal_metrics.commands import (alerts, compare, demo, grafana, publish, replay, report, sql, stack_cmd, sync, train,
                                    watch)
from areal_metrics.producers.contract.limits import StructureLimits, install_limits
from areal_metrics.producers.contract.settings import is_set, read_setting

# verb -> (module, one-line help); a module may serve several verbs
VERBS: dict[str, tuple[ModuleType, str]] = {
    "up": (stack_cmd, "start the local stack (Kafka broker, stream worker, ClickHouse sink); your scripts find it"),
    "down": (stack_cmd, "stop the local stack (its data stays)"),
    "status": (stack_cmd, "say whether the local stack runs, and where (--json: its addresses and SQL DSN)"),
    "demo": (demo, "try it all: the stack, a distributed PPO training with evaluation, a live view, a report"),
    "train": (train, "run the reference distributed PPO trainer, reporting to the stack"),
    "watch": (watch, "follow your runs live in the terminal: reward, evaluations, alerts"),
    "alerts": (alerts, "print alerts as JSON lines; --follow keeps waiting, --webhook posts them to Slack or any URL"),
    "sql": (sql, "query your runs with SQL (tables steps, evals, runs, alerts, ...)"),
    "report": (report, "draw your runs' figures as PNG (reward, accuracy, throughput, any --metric)"),
    "compare": (compare, "compare two groups of runs on an evaluation set: intervals over runs, a paired per-sample test"),
    "grafana": (grafana, "set up Grafana: push the data source and the dashboards to a Grafana URL"),
    "replay": (replay, "rebuild the ClickHouse tables from the Kafka log"),
    "publish": (publish, "send JSON events (a command to trainers, say) from a file or stdin; exit 1 if not delivered"),
    "sync": (sync, "send the events your runs kept on disk while the broker was away"),
}


DESCRIPTION = "Streaming metrics and evaluation for RL training of LLMs: your trainers log, the stack keeps it."
EPILOG = """first steps:
  areal-metrics up                 start the stack (once)
  python train.py                  your script: run = areal_metrics.init(); run.log({...}, step=step)
  areal-metrics watch              follow it live
  areal-metrics sql 'SELECT run_id, max(step) FROM v_steps GROUP BY run_id'
  areal-metrics report --out reports

exit status: 0 done; 2 bad input (the message says what and where); 1 a service could not be
reached or an event was not delivered. `areal-metrics VERB --help` for a verb's options."""


def version() -> str:
    import areal_metrics

    return areal_metrics.__version__


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="areal-metrics", description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"areal-metrics {version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=OneLineParser)
    sub.required = True
    for verb, (module, help_text) in VERBS.items():
        verb_parser = sub.add_parser(verb, help=help_text, description=help_text)
        module.add_arguments(verb_parser, verb)
        verb_parser.set_defaults(run=module.run)
    return parser


def use_local_stack_bootstrap() -> None:
    """Point this process and its children (trainers, services) at the broker of the local stack,
    through the environment they inherit (Settings.from_env also finds it by itself)."""
    from areal_metrics.stack.services import read_info

    if is_set("kafka_bootstrap"):
        return
    info = read_info()
    if info is not None and info.kafka_bootstrap:
        os.environ["AREAL_KAFKA_BOOTSTRAP"] = info.kafka_bootstrap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # the ClickHouse driver logs each failed connection attempt; the verb says it once, on one line
    logging.getLogger("clickhouse_connect").setLevel(logging.CRITICAL)
    try:
        use_local_stack_bootstrap()
        # the structure limits (AREAL_MAX_*) of every message a verb reads, installed for the process
        install_limits(StructureLimits(*(read_setting(name) for name in StructureLimits.SETTINGS)))
        extras.check_verb(args.verb, getattr(args, "action", None))  # the thin install: name the extra
        return int(args.run(args) or 0)
    except ArealError as exc:  # every error raised on purpose: one line, its exit code (2 bad input, 1 a service)
        print(f"areal-metrics {args.verb}: error: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except ImportError as exc:  # an extra's module imported deeper (chdb, torch): one line naming the extra
        found = extras.from_import_error(exc, args.verb)
        if found is None:
            raise
        print(f"areal-metrics {args.verb}: error: {one_line(found)}", file=sys.stderr)
        return found.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `areal-metrics status | head`: the reader left; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit would fail
        return 0
    except OSError as exc:  # a file or stream no verb expected to fail (stdout on a full disk): one line
        print(f"areal-metrics {args.verb}: error: {one_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
