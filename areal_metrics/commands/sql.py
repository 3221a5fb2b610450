"""`areal-metrics sql QUERY`: ad hoc SQL against the configured ClickHouse, also while the stack runs."""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from typing import Any

FORMATS = ("table", "tsv", "csv", "json")


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("query", help="the SQL to run (tables of database `areal`; see docs/CLICKHOUSE.md)")
    parser.add_argument("--format", choices=FORMATS, default="table", help="output format (default: table)")
    parser.add_argument("--write", action="store_true", help="allow changes (INSERT, ALTER, DDL); read-only otherwise")


def _text(v: Any) -> str:
    if v is None:
        return "NULL"
    if isinstance(v, (dict, list, tuple)):
        return json.dumps(_jsonable(v), separators=(",", ":"))
    if hasattr(v, "isoformat"):
        return v.isoformat()
    return str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "isoformat"):
        return v.isoformat()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)


def render(columns: list[str], rows: list[tuple[Any, ...]], fmt: str) -> str:
    if fmt == "json":  # JSON lines, one object per row
        return "".join(json.dumps(dict(zip(columns, _jsonable(list(r)))), default=str) + "\n" for r in rows)
    if fmt in ("tsv", "csv"):
        out = io.StringIO()
        writer = csv.writer(out, delimiter="\t" if fmt == "tsv" else ",", lineterminator="\n")
        writer.writerow(columns)
        writer.writerows([_text(v) for v in r] for r in rows)
        return out.getvalue()
    cells = [[_text(v) for v in r] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells]
    lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """Exit 2 for a bad URL or query, 1 when the store cannot be reached (CONTRACT.md, 'Adoption')."""
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.sinks.query import connect

    # a URL that cannot work: ConfigError (exit 2); a store that does not answer: StoreUnavailable (exit 1)
    with connect(Settings.from_env(), write=args.write) as store:
        result = store.query(args.query)  # a query it refuses: QueryError (exit 2)
    sys.stdout.write(render(result.columns, result.rows, args.format))
    return 0
