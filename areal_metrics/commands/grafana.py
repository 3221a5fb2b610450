"""`areal-metrics grafana ACTION`: the dashboards as code.

- `provision --url URL --token TOKEN [--clickhouse-url URL] [--webhook URL]`: push the ClickHouse
  datasource (uid areal-clickhouse), every dashboard and the alert rules (NaN, stall, evaluation
  below threshold, node divergence, poison messages; with --webhook, a webhook contact point they
  notify) to a running Grafana;
  `provision --files DIR`: write them as a provisioning folder instead (for a
  Grafana on this machine: `GF_PATHS_PROVISIONING=DIR grafana server`).
  ClickHouse defaults to the configured server, or, for the embedded store, the
  running sink's ClickHouse HTTP endpoint (the read-only DSN of `status --json`).
- `generate [--out DIR]`: write the dashboards' JSON (and the provisioning files).
- `check [--since 1h]`: run every panel's query, expanded as Grafana would, against
  the configured ClickHouse; a query that fails or returns the wrong shape is a failure
  (exit 1), one that returns nothing (a column nobody logged yet) is "no data yet" (exit 0).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from areal_metrics.errors import ServiceUnavailable, UserError
from areal_metrics.grafana.settings import GrafanaSettings
from areal_metrics.commands.arguments import check_http_url, folder, seconds

if TYPE_CHECKING:
    from areal_metrics.grafana.provision import ClickHouseServer

CLICKHOUSE_URL_ENV = "AREAL_GRAFANA_CLICKHOUSE_URL"


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", parser_class=type(parser))
    actions.required = True

    provision = actions.add_parser("provision", help="push the datasource and the dashboards to a Grafana")
    where = provision.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="Grafana's URL, e.g. http://localhost:3000")
    where.add_argument("--files", type=folder, metavar="DIR",
                       help="write a provisioning folder (datasources/, dashboards/) for a Grafana on this machine")
    provision.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                           help="service account token (default: $GRAFANA_TOKEN; or put user:password in --url)")
    provision.add_argument(
        "--clickhouse-url",
        default=None,
        help="ClickHouse as Grafana reaches it: http(s)://user:pass@host:8123 or clickhouse://user:pass@host:9000 "
        f"(default: ${CLICKHOUSE_URL_ENV}, else AREAL_CLICKHOUSE_URL when it is a server, else the running "
        "sink's endpoint of the embedded store)",
    )
    provision.add_argument("--webhook", default=None, metavar="URL",
                           help="the URL the alert rules notify (a webhook contact point; default: "
                           "$AREAL_GRAFANA_ALERT_WEBHOOK, else Grafana's default notification policy)")
    provision.add_argument("--stall-minutes", type=float, default=None, metavar="N",
                           help="the stall rule fires for a running run without a step for N minutes "
                           "(default: $AREAL_GRAFANA_STALL_MINUTES, else 10)")
    provision.add_argument("--timeout", type=seconds, default=10.0, help="seconds per HTTP request (default: 10)")

    generate = actions.add_parser("generate", help="write the dashboards' JSON and the provisioning files")
    generate.add_argument("--out", type=Path, default=None,
                          help="folder for dashboards/ and provisioning/ (default: grafana/ of this checkout)")

    check = actions.add_parser("check", help="run every panel query against the configured ClickHouse")
    check.add_argument("--since", default="1h", help="time range to check, ending now: 30m, 6h, 2d (default: 1h)")
    check.add_argument("--run", action="append", dest="runs", default=None, metavar="ID",
                       help="the run(s) to select (default: every run the variable offers)")


def run(args: argparse.Namespace) -> int:
    if args.action == "provision":
        return _provision(args)
    if args.action == "generate":
        return _generate(args)
    return _check(args)


# ------------------------------------------------------------------ provision


def _clickhouse_for_grafana(explicit: str | None, own: GrafanaSettings) -> str:
    if explicit:
        return explicit
    if own.grafana_clickhouse_url:
        return own.grafana_clickhouse_url
    from areal_metrics.producers.contract.settings import Settings

    from areal_metrics.sinks.query import http_dsn

    settings = Settings.from_env()
    dsn = http_dsn(settings)
    if dsn is None:
        raise ServiceUnavailable(
            f"no process serves the embedded store {settings.clickhouse_url.split('?')[0]} over HTTP: start the stack "
            "(`areal-metrics up`: its sink serves it), or pass --clickhouse-url http://user:pass@host:8123"
        )
    return dsn


def _provision(args: argparse.Namespace) -> int:
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaException

    from areal_metrics.grafana.provision import ClickHouseServer, push
    from areal_metrics.producers.contract.settings import mask_url

    own = GrafanaSettings.from_env()  # AREAL_GRAFANA_*
    try:
        server = ClickHouseServer.parse(_clickhouse_for_grafana(args.clickhouse_url, own))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    webhook = args.webhook if args.webhook is not None else own.grafana_alert_webhook
    if webhook:
        check_http_url("--webhook", webhook, "http(s)://host/path")
    stall = args.stall_minutes if args.stall_minutes is not None else own.grafana_stall_minutes
    if not 1 <= stall <= 1440:
        raise UserError(f"--stall-minutes {stall:g}: expected a number of minutes from 1 to 1440")
    if args.files is not None:
        return _provision_files(args.files, server, webhook, stall)
    check_http_url("--url", args.url, "http(s)://host:port")
    api = GrafanaApi.from_url(args.url, credential=args.token or None, timeout=args.timeout)
    where = mask_url(args.url)
    try:
        pushed = push(api, server, webhook=webhook or None, stall_minutes=stall)
    except GrafanaException as exc:
        said = f"{exc.status_code} {' '.join(str(exc.message).split())[:300]}"
        if not exc.status_code:  # no answer at all (grafana-client says 0 for a read that timed out): exit 1
            raise ServiceUnavailable(f"Grafana at {where} did not answer: {said}") from None
        if exc.status_code >= 500:  # Grafana is there but failing: a service error
            raise ServiceUnavailable(f"Grafana at {where} failed: {said}") from None
        raise UserError(f"Grafana at {where} refused: {said}") from None  # a token, a permission, a request
    except Exception as exc:  # noqa: BLE001 - connection refused, DNS, TLS: unreachable, exit 1
        raise ServiceUnavailable(f"cannot reach Grafana at {where}: {' '.join(str(exc).split())[:300]}") from None
    print(f"datasource {pushed.datasource} (uid areal-clickhouse -> {server.protocol}://{server.host}:{server.port}); "
          f"folder {pushed.folder}; dashboards: {', '.join(pushed.dashboards)}; alert rules: "
          f"{', '.join(pushed.alert_rules)}; "
          + (f"webhook contact point {pushed.contact_point}" if pushed.contact_point
             else "no webhook (--webhook URL): rules notify Grafana's default policy"))
    return 0


def _provision_files(directory: Path, server: ClickHouseServer, webhook: str | None, stall: float) -> int:
    from areal_metrics.grafana.catalog import write_all
    from areal_metrics.grafana.provision import write_provisioning

    dashboards = (directory / "dashboards" / "areal").absolute()
    try:
        written = write_all(dashboards) + write_provisioning(directory, server, str(dashboards),
                                                             webhook=webhook or None, stall_minutes=stall)
    except OSError as exc:  # a file where a folder goes, a folder that cannot be made
        raise UserError(f"--files {str(directory)[:200]!r}: cannot write there ({exc.strerror or exc}: "
                        f"{exc.filename})") from None
    for path in written:
        print(path)
    print(f"datasource uid areal-clickhouse -> {server.protocol}://{server.host}:{server.port}; "
          f"start Grafana with GF_PATHS_PROVISIONING={directory.absolute()}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------- generate


def _generate(args: argparse.Namespace) -> int:
    from areal_metrics.grafana.catalog import repo_root, write_all
    from areal_metrics.grafana.provision import write_provisioning

    out = args.out or repo_root() / "grafana"  # the committed copies by default
    written = write_all(out / "dashboards") + write_provisioning(out / "provisioning")
    for path in written:
        print(path)
    return 0


# ---------------------------------------------------------------------- check


def parse_since(text: str) -> timedelta:
    match = re.fullmatch(r"(\d+)([smhd])", text.strip())
    if not match:
        raise UserError(f"--since {text!r}: expected a number and a unit, e.g. 30m, 6h, 2d")
    return timedelta(**{{"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}[match.group(2)]: int(match.group(1))})


def _check(args: argparse.Namespace) -> int:
    from areal_metrics.grafana.catalog import all_models
    from areal_metrics.grafana.queries import QueryRunner, check_dashboard
    from areal_metrics.sinks.query import QueryError, connect

    end = datetime.now(timezone.utc)
    start = end - parse_since(args.since)
    runs = tuple(args.runs) if args.runs else None

    def choose(name: str, options: list[str]) -> object:
        if name == "run":
            return runs or tuple(options)
        return "$__all"

    failures = empty = total = 0
    with connect() as store:
        runner = QueryRunner.of_store(store)
        for name, model in all_models().items():
            try:
                outcomes = check_dashboard(model, runner, start, end, choose)  # type: ignore[arg-type]
            except QueryError as exc:  # the store refused it (exit 2); a store that went away stays StoreUnavailable
                raise QueryError(f"dashboard {name}: variable query failed: {exc}") from None
            for o in outcomes:
                total += 1
                status = "ok" if o.problem is None else f"no data yet ({o.problem})" if o.empty else f"FAILED: {o.problem}"
                empty += o.empty
                failures += o.problem is not None and not o.empty
                print(f"{name:<11} {o.query.where} {o.context}: {status} ({o.rows} rows)")
    print(f"{total} queries: {total - failures - empty} with data, {empty} no data yet (nothing logged for them in "
          f"--since {args.since}), {failures} failed", file=sys.stderr)
    return 1 if failures else 0
