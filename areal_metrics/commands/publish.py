"""`publish`: validate JSON events (one per line) and publish them.

Handy for people and scripts, e.g. a command to the trainers:
    echo '{"type":"command","run_id":"r1","event_id":"c1","ts":0,"command":"evaluate_now"}' | areal-metrics publish -
Invalid lines go to the dead-letter topic with the reason; the verb then
prints the first reason on one line and exits 2. The verb waits (up to
`--timeout` seconds, with progress on a terminal) for the broker to acknowledge
every event; what was not acknowledged stays in the CLI's journal, is sent first
by the next `publish`, and the verb exits 1 saying so.
"""

from __future__ import annotations

import argparse
import socket
import sys
from typing import TYPE_CHECKING

from areal_metrics.producers.contract.deadletter import rejected
from areal_metrics.producers.contract.events import ValidationError, event_from_dict
from areal_metrics.producers.contract.settings import Settings, state_dir

from areal_metrics.errors import ServiceUnavailable, UserError
from areal_metrics.commands.arguments import seconds

if TYPE_CHECKING:
    from areal_metrics.producers.delivery.publisher import Publisher


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("file", help="a file of JSON lines, or - for standard input")
    parser.add_argument("--fill", action="store_true",
                        help="fill in a missing event_id and ts (new events written by hand)")
    parser.add_argument("--timeout", type=seconds, default=15.0,
                        help="seconds to wait for the broker's acknowledgement (default 15)")


def run(args: argparse.Namespace) -> int:
    import json
    import time

    from areal_metrics.producers.contract.events import new_event_id
    from areal_metrics.producers.delivery.publisher import Publisher

    try:
        # bytes: a line that is not UTF-8 is dead-lettered (as base64) like any other bad line
        stream = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")
    except OSError as exc:
        raise UserError(f"cannot read {args.file}: {exc.strerror}") from None
    settings = Settings.from_env()
    # one journal for the CLI: what a run could not send, the next run sends first
    journal = state_dir() / "journal" / "cli"
    try:
        publisher = Publisher.from_settings(settings, journal_dir=journal)
    except OSError as exc:  # AREAL_HOME a file, or not this user's
        raise UserError(f"cannot make the CLI's journal {journal} ({exc.strerror or exc}): check AREAL_HOME") from None
    first_error = None
    count = 0
    try:
        with stream:
            for number, line in enumerate(stream, start=1):
                if not line.strip():
                    continue
                try:
                    data = _decode(line)
                    if args.fill and isinstance(data, dict):
                        data.setdefault("event_id", new_event_id())
                        data.setdefault("ts", time.time())
                    publisher.publish(event_from_dict(data))
                    count += 1
                except (ValueError, RecursionError) as exc:
                    reason = str(exc) if isinstance(exc, ValidationError) else f"event: not valid JSON ({exc})"
                    first_error = first_error or f"line {number}: {reason}"
                    publisher.publish(rejected(line.rstrip(b"\r\n"), reason, "cli:" + args.file, node=socket.gethostname()))
    finally:
        delivered = _wait_delivered(publisher, args.timeout, settings.kafka_bootstrap)
    if not delivered:
        raise ServiceUnavailable(
            f"not delivered: the broker at {settings.kafka_bootstrap} did not acknowledge within {args.timeout:g} s; "
            f"what was not acknowledged of {count} event(s) is kept in the journal {publisher.journal.directory} "
            "and sent first by the next `publish`"
            + (f"; and the input has bad lines, the first: {first_error} (kept for the dead-letter topic)"
               if first_error else ""))
    if first_error:
        raise UserError(first_error + " (sent to the dead-letter topic)")
    print(f"published {count} event(s)")
    return 0


def _decode(line: bytes) -> object:
    """One line's JSON; ValidationError when it is not UTF-8, ValueError when not JSON."""
    import json

    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError("event", f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    return json.loads(text)


def _wait_delivered(publisher: Publisher, timeout: float, bootstrap: str) -> bool:
    """Wait for every acknowledgement (progress on a terminal); close; True when all were acknowledged."""
    from areal_metrics.progress import wait_for

    try:
        return wait_for(lambda: publisher.flush(0.05), timeout, f"waiting for the broker at {bootstrap}")
    finally:
        publisher.close(timeout=1.0)
