"""`areal-metrics replay`: rebuild the ClickHouse tables from the Kafka log."""

from __future__ import annotations

import argparse

from areal_metrics.errors import ArealError, ServiceUnavailable


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.description = (
        "Drop and rebuild every table from the earliest offsets of every topic. "
        "Works while the stack runs (the running sink performs it) and after, with the broker up."
    )
    parser.add_argument("--force", action="store_true",
                        help="rebuild even when retention already deleted the start of the log")


def run(args: argparse.Namespace) -> int:
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.sinks.query import store_error
    from areal_metrics.sinks.replay import run_replay

    settings = Settings.from_env()
    try:
        counts = run_replay(settings, force=args.force)
    except ArealError:  # a refusal or a bad URL (exit 2), a store that does not answer (exit 1): said as raised
        raise
    except Exception as exc:  # noqa: BLE001 - Kafka or ClickHouse unreachable, or the store refused: one line
        if type(exc).__name__ in ("NoBrokersAvailable", "KafkaTimeoutError"):
            raise ServiceUnavailable(f"replay reads the Kafka log, but no broker answers at {settings.kafka_bootstrap} "
                                     "(start it with `areal-metrics up`)") from None
        raise store_error(exc, "replay failed") from None
    for table, n in counts.items():
        print(f"{table}\t{n}")
    return 0
