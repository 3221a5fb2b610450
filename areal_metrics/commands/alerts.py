"""`alerts`: print alerts as JSON lines; `--follow` keeps subscribing."""

from __future__ import annotations

import argparse
import json
import sys
import time

from producers.events import AlertEvent, ValidationError, parse_event
from producers.settings import Settings


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--follow", "-f", action="store_true", help="keep subscribing for new alerts")
    parser.add_argument("--run", dest="runs", action="append", default=[], metavar="ID",
                        help="only these runs (repeatable)")
    parser.add_argument("--kind", dest="kinds", action="append", default=[], help="only these alert kinds (repeatable)")
    parser.add_argument("--new", action="store_true", help="skip alerts already in the log; print new ones only")
    parser.add_argument("--timeout", type=float, default=None,
                        help="with --follow: stop after this many seconds")


def run(args: argparse.Namespace) -> int:
    from kafka import KafkaConsumer
    from kafka.errors import KafkaError

    settings = Settings.from_env()
    topic = settings.topics.alerts
    try:
        consumer = KafkaConsumer(
            topic, **settings.kafka_python_config(),
            auto_offset_reset="latest" if args.new else "earliest",
            enable_auto_commit=False, group_id=None, consumer_timeout_ms=1000,
        )
    except KafkaError:
        from areal_metrics.errors import UserError

        raise UserError(f"no Kafka broker at {settings.kafka_bootstrap} (start one with `areal-metrics up`)") from None
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    idle_rounds = 0
    try:
        while True:
            got = False
            for message in consumer:
                got = True
                try:
                    alert = parse_event(message.value, expected=AlertEvent)
                except ValidationError as exc:
                    print(f"skipped an invalid message at {message.topic}/{message.partition}@{message.offset}: {exc}",
                          file=sys.stderr)
                    continue
                if (args.runs and alert.run_id not in args.runs) or (args.kinds and alert.kind not in args.kinds):
                    continue
                print(json.dumps(alert.to_dict()), flush=True)
            idle_rounds = 0 if got else idle_rounds + 1
            if deadline is not None and time.monotonic() > deadline:
                return 0
            if not args.follow and idle_rounds >= 2:  # caught up with the log
                return 0
    finally:
        consumer.close()
