"""`up`, `down`, `status`: the local stack."""

from __future__ import annotations

import argparse
import json

from areal_metrics.stack import services as stack
from producers.settings import mask_url
from areal_metrics.errors import ServiceUnavailable, UserError


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    if verb == "up":
        parser.add_argument("--partitions", type=int, default=3, help="partitions per topic (default 3)")
        parser.add_argument("--no-worker", action="store_true", help="do not start the stream worker")
        parser.add_argument("--no-sink", action="store_true", help="do not start the ClickHouse sink")
    if verb == "status":
        parser.add_argument("--json", action="store_true", help="print the state as JSON")


def _clickhouse_http(clickhouse_url: str) -> str | None:
    """The read-only DSN any ClickHouse client can use: the server's URL, or the sink's endpoint of the embedded store."""
    from producers.settings import Settings
    from sinks.query import StoreError, http_dsn

    try:
        return http_dsn(Settings(clickhouse_url=clickhouse_url))
    except StoreError:
        return None


def run(args: argparse.Namespace) -> int:
    if args.verb == "up":
        if args.partitions < 1:
            raise UserError(f"--partitions must be >= 1 (got {args.partitions})")
        services = tuple(s for s in stack.SERVICES if not getattr(args, f"no_{s}"))
        try:
            info, started = stack.up(args.partitions, services)
        except (RuntimeError, TimeoutError) as exc:
            raise ServiceUnavailable(str(exc)) from None
        word = "started" if started else "already running"
        print(f"stack {word}: kafka {info.kafka_version} at {info.kafka_bootstrap}, "
              f"{', '.join(info.pids)}; state in {info.home}")
        return 0
    if args.verb == "down":
        stopped = stack.down()
        print(f"stopped: {', '.join(stopped)}" if stopped else "nothing was running")
        return 0
    info = stack.read_info()
    running = info is not None and info.running()
    if args.json:
        out = {"running": running}
        if info is not None:
            out.update(
                kafka_bootstrap=info.kafka_bootstrap, kafka_version=info.kafka_version,
                topic_prefix=info.topic_prefix, clickhouse_url=mask_url(info.clickhouse_url), home=info.home,
                processes={name: {"pid": pid, "alive": alive}
                           for (name, pid), alive in zip(info.pids.items(), info.alive().values())},
                clickhouse_http=_clickhouse_http(info.clickhouse_url),
            )
        print(json.dumps(out))
    elif info is None:
        print("not running (no stack here)")
    else:
        parts = [f"{name} pid {pid} {'up' if alive else 'DOWN'}"
                 for (name, pid), alive in zip(info.pids.items(), info.alive().values())]
        print(f"{'running' if running else 'not running'}: kafka at {info.kafka_bootstrap}; "
              + ("; ".join(parts) if parts else "no processes"))
    return 0 if running else 1
