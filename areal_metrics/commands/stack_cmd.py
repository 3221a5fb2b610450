"""`up`, `down`, `status`: the local stack."""

from __future__ import annotations

import argparse
import json

from areal_metrics.stack import services as stack
from areal_metrics.producers.contract.settings import mask_url
from areal_metrics.errors import ConfigError, ServiceUnavailable, UserError


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    if verb == "up":
        parser.add_argument("--partitions", type=int, default=3, help="partitions per topic (default 3)")
        parser.add_argument("--brokers", type=int, default=None,
                            help="Kafka brokers: 1, or 3 for a KRaft cluster whose topics have replication factor 3 "
                                 "and min.insync.replicas 2 (default: as the stack here was made, else 1)")
        parser.add_argument("--no-worker", action="store_true", help="do not start the stream worker")
        parser.add_argument("--no-sink", action="store_true", help="do not start the ClickHouse sink")
    if verb == "status":
        parser.add_argument("--json", action="store_true", help="print the state as JSON")


def _clickhouse_http(clickhouse_url: str) -> str | None:
    """The read-only DSN any ClickHouse client can use: the server's URL, or the sink's endpoint of the embedded store."""
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.sinks.query import http_dsn

    try:
        return http_dsn(Settings(clickhouse_url=clickhouse_url))
    except ConfigError:  # a URL that cannot work: no DSN to show
        return None


def run(args: argparse.Namespace) -> int:
    if args.verb == "up":
        if args.partitions < 1:
            raise UserError(f"--partitions must be >= 1 (got {args.partitions})")
        if args.brokers is not None and not (args.brokers == 1 or 3 <= args.brokers <= 9):
            raise UserError(f"--brokers must be 1 or 3..9 (got {args.brokers}; a cluster of 2 cannot lose a node)")
        services = tuple(s for s in stack.SERVICES if not getattr(args, f"no_{s}"))
        try:
            info, started = stack.up(args.partitions, services, brokers=args.brokers)
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
        out: dict[str, object] = {"running": running}
        if info is not None:
            out.update(
                kafka_bootstrap=info.kafka_bootstrap, kafka_version=info.kafka_version, brokers=info.brokers,
                topic_prefix=info.topic_prefix, clickhouse_url=mask_url(info.clickhouse_url), home=info.home,
                processes={name: {"pid": pid, "alive": alive, **({"address": addr} if addr else {}),
                                  **({"restarts": stack.restarts(info.home, name)} if name in stack.SERVICES else {}),
                                  **({} if alive else {"state": "failed", "reason": _reason(info, name)})}
                           for name, pid, alive, addr in _processes(info)},
                clickhouse_http=_clickhouse_http(info.clickhouse_url),
            )
        print(json.dumps(out))
    elif info is None:
        print("not running (no stack here)")
    else:
        parts = [f"{name} pid {pid} {'up' if alive else 'DOWN'}" + (f" at {addr}" if addr else "")
                 + (f" (restarts {n})" if name in stack.SERVICES and (n := stack.restarts(info.home, name)) else "")
                 + ("" if alive or name not in stack.SERVICES else f" (failed: {_reason(info, name) or 'no output'})")
                 for name, pid, alive, addr in _processes(info)]
        print(f"{'running' if running else 'not running'}: kafka at {info.kafka_bootstrap}; "
              + ("; ".join(parts) if parts else "no processes"))
    return 0 if running else 1


def _reason(info: stack.StackInfo, name: str) -> str:
    """Why a process of the stack stopped: the last line its log holds (services; brokers: their log)."""
    return stack.failure_reason(info.home, name) if name in stack.SERVICES else ""


def _processes(info: stack.StackInfo) -> list[tuple[str, int, bool, str]]:
    """(name, pid, alive, broker address or "") of every process of the stack, each broker by name."""
    addresses = dict(zip(stack.broker_names(info.brokers), info.kafka_bootstrap.split(",")))
    alive = info.alive()
    return [(name, pid, alive[name], addresses.get(name, "")) for name, pid in info.pids.items()]
