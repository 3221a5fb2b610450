"""Reading (and, on request, writing) the ClickHouse store: one function for every reader.

    from sinks.query import connect

    with connect() as store:                      # Settings.from_env() when not given
        result = store.query("SELECT run_id, max(step) FROM v_steps GROUP BY run_id")
        columns, rows = result                    # also result.columns, .rows, .types
        n = store.command("SELECT count() FROM steps FINAL")   # a single value

`connect(settings=None, *, write=False)` picks the path from
`settings.clickhouse_url`:

- ``http(s)://user:pass@host:8123/db``: clickhouse-connect's HTTP client.
- ``chdb:///path`` (embedded engine): chdb lets ONE process open a data
  directory. When a running sink (`python -m sinks`, started by
  `areal-metrics up`) holds it, the sink answers queries on a loopback HTTP
  endpoint recorded in ``<path>/owner.json``, and `connect` returns a client
  of that endpoint. Otherwise `connect` opens the directory itself (and holds
  it until `close()`: keep such sessions short, the sink cannot start
  meanwhile, it waits and retries).

Read-only unless `write=True`: the session runs with ClickHouse's
``readonly=2`` (no INSERT/ALTER/DDL; reading settings may still change).
The default database is `areal` (or the one in the http URL's path), so
table names may be written without it. Errors are
`StoreError` with ClickHouse's message.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from producers.settings import Settings

from sinks.schema import DEFAULT_DATABASE

OWNER_FILE = "owner.json"
READONLY = {"readonly": 2}  # 2, not 1: clients may still pass per-query format settings


class StoreError(Exception):
    """A query failed, or the store cannot be reached; str() is one line."""


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed AREAL_CLICKHOUSE_URL."""

    kind: str  # "chdb" | "http"
    url: str
    database: str
    path: Path | None = None  # chdb data directory

    @classmethod
    def parse(cls, url: str) -> Target:
        parsed = urlparse(url)
        if parsed.scheme == "chdb":
            location = parsed.path if not parsed.netloc else parsed.netloc + parsed.path
            if not location or location in ("memory", ":memory:"):
                raise StoreError(f"AREAL_CLICKHOUSE_URL {url!r}: give a data directory, e.g. chdb:///var/lib/areal")
            return cls("chdb", url, DEFAULT_DATABASE, Path(location).absolute())
        if parsed.scheme in ("http", "https"):
            database = unquote(parsed.path.strip("/").split("/")[0]) or DEFAULT_DATABASE
            return cls("http", url, database)
        raise StoreError(f"AREAL_CLICKHOUSE_URL {url!r}: expected chdb:///path or http://user:pass@host:8123/db")


@dataclass(slots=True)
class QueryResult:
    """Columns, their ClickHouse types, rows (tuples). Unpacks as `columns, rows = result`."""

    columns: list[str]
    rows: list[tuple[Any, ...]]
    types: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Any]:
        yield self.columns
        yield self.rows


def one_line(exc: BaseException) -> str:
    """ClickHouse's message on one line, without the driver's trailers."""
    text = " ".join(str(exc).split())
    for junk in (" FORMAT Native", " FORMAT TabSeparatedWithNames"):
        text = text.replace(junk, "")
    return text


# ------------------------------------------------------------- direct clients


def open_client(target: Target, *, readonly: bool, use_database: bool = True) -> Any:
    """A clickhouse-connect client for the target (chdb opens the directory in this process)."""
    import clickhouse_connect

    settings = dict(READONLY) if readonly else {}
    database = target.database if use_database else None
    if target.kind == "chdb":
        assert target.path is not None
        target.path.mkdir(parents=True, exist_ok=True)
        client = clickhouse_connect.get_client(dsn=f"chdb://{target.path}", settings=settings)
        if database:
            try:
                client.database = database  # USE; absent before the schema exists
            except Exception:  # noqa: BLE001 - fall back to the default database
                pass
        return client
    # connect without the database (it may not exist before the schema does), then USE it
    parsed = urlparse(target.url)
    client = clickhouse_connect.get_client(dsn=parsed._replace(path="").geturl(), settings=settings)
    if database:
        client.database = database
    return client


def encode_value(v: Any) -> Any:
    """A query value as JSON (datetimes as ISO text, decoded again by column type)."""
    if isinstance(v, (dt.datetime, dt.date)):
        return v.isoformat()
    if isinstance(v, (list, tuple)):
        return [encode_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): encode_value(x) for k, x in v.items()}
    if isinstance(v, (bytes, bytearray)):
        return v.decode("utf-8", "replace")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)  # Decimal, UUID, IP addresses


def _decoder(ch_type: str) -> Any:
    t = ch_type.removeprefix("Nullable(").removeprefix("LowCardinality(")
    if t.startswith("DateTime"):
        return dt.datetime.fromisoformat
    if t.startswith("Date"):
        return dt.date.fromisoformat
    return None


def decode_rows(types: list[str], rows: list[list[Any]]) -> list[tuple[Any, ...]]:
    decoders = [_decoder(t) for t in types]
    if not any(decoders):
        return [tuple(r) for r in rows]
    return [tuple(d(v) if d and v is not None else v for d, v in zip(decoders, r)) for r in rows]


class DirectStore:
    """A store opened in this process (a ClickHouse server, or a chdb directory nobody else holds)."""

    def __init__(self, target: Target, client: Any, *, write: bool) -> None:
        self.target = target
        self.client = client
        self.write = write

    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> QueryResult:
        try:
            r = self.client.query(sql, parameters=parameters)
        except Exception as exc:  # noqa: BLE001 - every driver error becomes one line
            raise StoreError(one_line(exc)) from None
        types = [t.name for t in r.column_types]
        return QueryResult(list(r.column_names), [tuple(row) for row in r.result_rows], types)

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None) -> Any:
        try:
            return self.client.command(sql, parameters=parameters)
        except Exception as exc:  # noqa: BLE001
            raise StoreError(one_line(exc)) from None

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> DirectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------ the owner's endpoint


@dataclass(frozen=True, slots=True)
class Owner:
    pid: int
    port: int
    token: str


def read_owner(path: Path) -> Owner | None:
    """The live owner of a chdb directory, from <path>/owner.json; None when nobody holds it."""
    try:
        info = json.loads((path / OWNER_FILE).read_text())
        owner = Owner(int(info["pid"]), int(info["port"]), str(info["token"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return None  # a sink killed without cleanup left the file behind
    except PermissionError:
        pass
    try:  # the pid may have been reused by another program: is the endpoint there?
        socket.create_connection(("127.0.0.1", owner.port), timeout=1.0).close()
    except OSError:
        return None
    return owner


class OwnerStore:
    """Queries sent to the process that holds the chdb directory (a running sink)."""

    def __init__(self, target: Target, owner: Owner, *, write: bool, timeout: float = 300.0) -> None:
        self.target = target
        self.owner = owner
        self.write = write
        self.timeout = timeout

    def call(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.owner.port}/{op}",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Areal-Token": self.owner.token},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read()).get("error", str(exc))
            except ValueError:
                message = str(exc)
            raise StoreError(message) from None
        except (urllib.error.URLError, OSError) as exc:
            raise StoreError(f"the sink holding {self.target.path} (pid {self.owner.pid}) did not answer: {exc}") from None

    def query(self, sql: str, parameters: Mapping[str, Any] | None = None) -> QueryResult:
        out = self.call("query", {"sql": sql, "write": self.write, "parameters": dict(parameters or {})})
        types = out["types"]
        return QueryResult(out["columns"], decode_rows(types, out["rows"]), types)

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None) -> Any:
        return self.call("command", {"sql": sql, "write": self.write, "parameters": dict(parameters or {})})["result"]

    def close(self) -> None:
        pass

    def __enter__(self) -> OwnerStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


Store = DirectStore | OwnerStore


def connect(settings: Settings | None = None, *, write: bool = False, wait_s: float = 10.0) -> Store:
    """Open the configured store for queries (see the module docstring). Raises StoreError."""
    settings = settings or Settings.from_env()
    target = Target.parse(settings.clickhouse_url)
    if target.kind == "http":
        try:
            return DirectStore(target, open_client(target, readonly=not write), write=write)
        except Exception as exc:  # noqa: BLE001
            raise StoreError(f"cannot reach ClickHouse at {target.url.split('@')[-1]}: {one_line(exc)}") from None
    assert target.path is not None
    deadline = time.monotonic() + wait_s
    while True:
        owner = read_owner(target.path)
        if owner is not None:
            return OwnerStore(target, owner, write=write)
        try:
            return DirectStore(target, open_client(target, readonly=not write), write=write)
        except Exception as exc:  # noqa: BLE001 - locked by a process that has not published its endpoint yet
            if time.monotonic() > deadline:
                raise StoreError(f"cannot open the ClickHouse store {target.path}: {one_line(exc)}") from None
            time.sleep(0.2)
