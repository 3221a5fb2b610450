"""`alerts`: print alerts as JSON lines; `--follow` keeps subscribing.

Without `--group` every call reads the whole log (or only new alerts with
`--new`) and remembers nothing. With `--group NAME` the subscriber is a durable
Kafka consumer group: its position is committed after each printed batch, so a
subscriber that stops (or is killed) and starts again with the same NAME
resumes where it stopped (an alert printed just before a kill may be printed
again; none is skipped).

With `--webhook URL` each alert the flags select is also POSTed to URL
(`areal_metrics.commands.webhook`), and each alert's offset is committed as soon
as the receiver accepted it, in a durable group (one per URL unless `--group`).

SIGTERM (a service manager's stop, `kill`) ends the subscriber like Ctrl-C: it leaves its
consumer group on the way out, so a subscriber started again at once with the same group is
given the partitions at once instead of waiting for the old member's session to expire.
`--timeout` bounds every wait of the loop (a poll, a commit during a rebalance, a webhook's
retries); a commit that cannot finish in time is given up (those alerts may be printed or
posted again after a restart, none is skipped).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from areal_metrics.producers.contract.events import ALERT_KINDS, SEVERITIES, AlertEvent, ValidationError, parse_event
from areal_metrics.producers.contract.settings import Settings

from areal_metrics.commands import webhook
from areal_metrics.errors import ArealError, ServiceUnavailable, UserError
from areal_metrics.commands.arguments import seconds


# Every kind the stream worker raises (CONTRACT.md's list and the ones it added); a test holds it to streams/.

def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--follow", "-f", action="store_true", help="keep subscribing for new alerts")
    parser.add_argument("--run", dest="runs", action="append", default=[], metavar="ID",
                        help="only these runs (repeatable)")
    parser.add_argument("--kind", dest="kinds", action="append", default=[], metavar="KIND",
                        help=f"only alerts of this kind (repeatable): {', '.join(ALERT_KINDS)}")
    parser.add_argument("--severity", choices=SEVERITIES, default=None,
                        help="only alerts of this severity or higher (info < warning < critical)")
    parser.add_argument("--group", default=None, metavar="NAME",
                        help="a durable consumer group: a restarted subscriber resumes where it stopped")
    parser.add_argument("--new", action="store_true",
                        help="skip alerts already in the log (with --group: only for a new group)")
    parser.add_argument("--timeout", type=seconds, default=None,
                        help="with --follow: stop after this many seconds")
    parser.add_argument("--webhook", metavar="URL", default=None,
                        help="POST each alert as JSON with a `text` field (Slack-compatible) to URL, retrying with "
                             "backoff; a durable group (one per URL unless --group) resumes after a restart "
                             "without losing or re-posting an alert")
    parser.add_argument("--connect-timeout", type=seconds, default=10.0,
                        help="seconds to wait for the broker before exit status 1 (default 10)")


def wanted(alert: AlertEvent, runs: list[str], kinds: list[str], severity: str | None) -> bool:
    """The filter of the flags (pure)."""
    if runs and alert.run_id not in runs:
        return False
    if kinds and alert.kind not in kinds:
        return False
    return severity is None or SEVERITIES.index(alert.severity) >= SEVERITIES.index(severity)


def run(args: argparse.Namespace) -> int:
    unknown = sorted(set(args.kinds) - set(ALERT_KINDS))
    if unknown:
        raise UserError(f"--kind {unknown[0]!r}: not an alert kind; expected one of {', '.join(ALERT_KINDS)}")
    if args.group is not None and not args.group.strip():
        raise UserError("--group: must not be empty")
    poster = None
    if args.webhook is not None:
        poster = webhook.Poster(webhook.check_url(args.webhook))
        args.group = args.group or webhook.group_for(args.webhook)
    settings = Settings.from_env()
    try:
        with _sigterm_raises():
            consumer = _connect(settings, args)
            try:
                return _follow(consumer, args, poster)
            finally:
                consumer.close(autocommit=False, timeout_ms=CLOSE_TIMEOUT_MS)  # leaves the group
    except Terminated as exc:
        return exc.exit_code


POLL_MS = 1000
COMMIT_TIMEOUT_MS = 30_000  # without --timeout: a commit that waits longer is given up, the loop goes on
COMMIT_GRACE_MS = 2000  # what a commit may take even at --timeout's deadline (the batch just printed)
CLOSE_TIMEOUT_MS = 3000


class Terminated(ArealError):
    """SIGTERM arrived: unwind so that the consumer is closed and leaves its group (then exit 143)."""

    exit_code = 128 + signal.SIGTERM


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While in the block, SIGTERM raises Terminated (once: a second SIGTERM kills at once)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _left_ms(deadline: float | None, cap: int) -> int:
    """Milliseconds a wait may take: `cap`, or less when --timeout's deadline is nearer."""
    if deadline is None:
        return cap
    return max(0, min(cap, int((deadline - time.monotonic()) * 1000)))


def _follow(consumer: Any, args: argparse.Namespace, poster: webhook.Poster | None) -> int:
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    idle_rounds = 0
    while True:
        batches = consumer.poll(timeout_ms=_left_ms(deadline, POLL_MS))
        for message in (m for records in batches.values() for m in records):
            alert = _print_if_wanted(message, args)
            if poster is not None:
                if alert is not None:
                    poster.post(alert, deadline)
                _commit(consumer, deadline, message)  # right after the receiver took it: never posted twice
        if batches and args.group and poster is None:
            _commit(consumer, deadline)  # after the batch is printed: a restart resumes after it
        idle_rounds = 0 if batches else idle_rounds + 1
        if deadline is not None and time.monotonic() >= deadline:
            return 0
        if not args.follow and idle_rounds >= 2:  # caught up with the log
            return 0


def _commit(consumer: Any, deadline: float | None, message: Any = None) -> None:
    """Commit the consumed positions (or just past `message`), waiting no longer than --timeout allows."""
    from kafka import TopicPartition
    from kafka.errors import KafkaError
    from kafka.structs import OffsetAndMetadata

    offsets = None
    if message is not None:
        offsets = {TopicPartition(message.topic, message.partition): OffsetAndMetadata(message.offset + 1, "", -1)}
    try:
        consumer.commit(offsets, timeout_ms=max(COMMIT_GRACE_MS, _left_ms(deadline, COMMIT_TIMEOUT_MS)))
    except KafkaError as exc:  # a rebalance took the partitions, or the coordinator is away: redelivered later
        print(f"could not commit the group's position ({type(exc).__name__}): "
              "a restart may print these alerts again", file=sys.stderr)


def _print_if_wanted(message: Any, args: argparse.Namespace) -> AlertEvent | None:
    """Print the message's alert when the flags want it; that alert, or None."""
    try:
        alert = parse_event(message.value, expected=AlertEvent)
    except ValidationError as exc:
        print(f"skipped an invalid message at {message.topic}/{message.partition}@{message.offset}: {exc}",
              file=sys.stderr)
        return None
    if wanted(alert, args.runs, args.kinds, args.severity):
        print(json.dumps(alert.to_dict()), flush=True)
        return alert
    return None


def _connect(settings: Settings, args: argparse.Namespace) -> Any:
    """A consumer of the alerts topic; waits up to --connect-timeout for the broker, else exit 1."""
    from kafka import KafkaConsumer
    from kafka.errors import KafkaError

    from areal_metrics.producers.runtime.kafka_wait import closed_on_failure
    from areal_metrics.progress import wait_for

    made: list[Any] = []

    def attempt() -> bool:
        try:
            made.append(closed_on_failure(  # a failed try leaves no I/O thread behind (kafka_wait.py)
                KafkaConsumer,
                **settings.kafka_python_config(),
                auto_offset_reset="latest" if args.new else "earliest",
                enable_auto_commit=False, group_id=args.group, bootstrap_timeout_ms=2000,
            ))
        except KafkaError:
            return False
        return True

    if not wait_for(attempt, args.connect_timeout, f"waiting for Kafka at {settings.kafka_bootstrap}", interval=0.5):
        raise ServiceUnavailable(f"no Kafka broker answers at {settings.kafka_bootstrap} "
                                 f"(waited {args.connect_timeout:g} s; start one with `areal-metrics up`)")
    consumer = made[0]
    consumer.subscribe([settings.topics.alerts])
    return consumer
