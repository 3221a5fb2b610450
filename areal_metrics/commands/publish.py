"""`publish`: validate JSON events (one per line) and publish them.

Handy for people and scripts, e.g. a command to the trainers:
    echo '{"type":"command","run_id":"r1","event_id":"c1","ts":0,"command":"evaluate_now"}' | areal-metrics publish -
Invalid lines go to the dead-letter topic with the reason; the verb then
prints the first reason on one line and exits 2.
"""

from __future__ import annotations

import argparse
import socket
import sys

from producers.deadletter import rejected
from producers.events import ValidationError, event_from_dict
from producers.settings import Settings, state_dir

from areal_metrics.errors import UserError


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("file", help="a file of JSON lines, or - for standard input")
    parser.add_argument("--fill", action="store_true",
                        help="fill in a missing event_id and ts (new events written by hand)")


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import time

    from producers.events import new_event_id
    from producers.publisher import Publisher

    try:
        stream = sys.stdin if args.file == "-" else open(args.file, encoding="utf-8")
    except OSError as exc:
        raise UserError(f"cannot read {args.file}: {exc.strerror}") from None
    settings = Settings.from_env()
    # one journal for the CLI: what a run could not send, the next run sends first
    publisher = Publisher.from_settings(settings, journal_dir=state_dir() / "journal" / "cli")
    first_error = None
    count = 0
    try:
        with stream:
            for number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                    if args.fill and isinstance(data, dict):
                        data.setdefault("event_id", new_event_id())
                        data.setdefault("ts", time.time())
                    publisher.publish(event_from_dict(data))
                    count += 1
                except (ValueError, RecursionError) as exc:
                    reason = str(exc) if isinstance(exc, ValidationError) else f"event: not valid JSON ({exc})"
                    first_error = first_error or f"line {number}: {reason}"
                    publisher.publish(rejected(line.rstrip("\n"), reason, "cli:" + args.file, node=socket.gethostname()))
    finally:
        delivered = publisher.flush(30)
        publisher.close()
    if not delivered:
        print(f"broker at {settings.kafka_bootstrap} not reachable: {count} event(s) kept in the journal "
              "and sent by the next `publish`", file=sys.stderr)
    if first_error:
        raise UserError(first_error + " (sent to the dead-letter topic)")
    print(f"published {count} event(s)")
    return 0
