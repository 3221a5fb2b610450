"""Reading (and, on request, writing) the ClickHouse store: one function for every reader.

    from areal_metrics.sinks.query import connect

    with connect() as store:                      # Settings.from_env() when not given
        result = store.query("SELECT run_id, max(step) FROM v_steps GROUP BY run_id")
        columns, rows = result                    # also result.columns, .rows, .types
        n = store.command("SELECT count() FROM steps FINAL")   # a single value

`connect(settings=None, *, write=False)` picks the path from
`settings.clickhouse_url`:

- ``http(s)://user:pass@host:8123/db``: clickhouse-connect's HTTP client.
- ``chdb:///path`` (embedded engine): chdb lets ONE process open a data
  directory. When a running sink (`python -m areal_metrics.sinks`, started by
  `areal-metrics up`) holds it, the sink serves it over ClickHouse's HTTP
  interface on loopback (`areal_metrics.sinks.http.server`; port and passwords in
  ``<path>/owner.json``), and `connect` returns a clickhouse-connect HTTP
  client of that endpoint, as user `reader` (or `writer` with `write=True`).
  Otherwise `connect` opens the directory itself (and holds it until
  `close()`: keep such sessions short, the sink cannot start meanwhile, it
  waits and retries).

Read-only unless `write=True` (ClickHouse's ``readonly``: no INSERT, ALTER or
DDL). The default database is `areal` (or the one in the http URL's path), so
table names may be written without it. Errors are `StoreError`s with
ClickHouse's message on one line, of one of two kinds (`store_error` picks it):
`StoreUnavailable` (a ServiceUnavailable, exit 1) when the store did not answer,
`QueryError` (a UserError, exit 2) when it answered and refused. An
AREAL_CLICKHOUSE_URL that cannot work is a `ConfigError` (exit 2).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import ParseResult, unquote, urlparse

from areal_metrics.producers.contract.settings import Settings

from areal_metrics.sinks.schema import DEFAULT_DATABASE
from areal_metrics.producers.contract.errors import ArealError, ConfigError, ServiceUnavailable, UserError, one_line

OWNER_FILE = "owner.json"
READONLY = {"readonly": 2}  # 2, not 1: clients may still pass per-query format settings


class StoreError(ArealError):
    """The store failed; str() is one line. Each one raised is of a kind below, which sets the exit code."""


class StoreUnavailable(StoreError, ServiceUnavailable):
    """The store did not answer: not reachable, not opened in time, the connection lost (exit 1)."""


class QueryError(StoreError, UserError):
    """The store answered and refused: a query it cannot run, a user or database it does not know (exit 2)."""


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed AREAL_CLICKHOUSE_URL."""

    kind: str  # "chdb" | "http"
    url: str
    database: str
    path: Path | None = None  # chdb data directory

    @classmethod
    def parse(cls, url: str) -> Target:
        try:
            parsed = urlparse(url)
            parsed.port  # noqa: B018 - read for its check: a port out of range raises here, not in a query
        except ValueError as exc:  # an unclosed IPv6 bracket, a port that is not a number
            raise ConfigError(f"AREAL_CLICKHOUSE_URL {url!r}: {exc}") from None
        if parsed.scheme == "chdb":
            location = parsed.path if not parsed.netloc else parsed.netloc + parsed.path
            if not location or location in ("memory", ":memory:"):
                raise ConfigError(f"AREAL_CLICKHOUSE_URL {url!r}: give a data directory, e.g. chdb:///var/lib/areal")
            return cls("chdb", url, DEFAULT_DATABASE, Path(location).absolute())
        if parsed.scheme in ("http", "https"):
            database = unquote(parsed.path.strip("/").split("/")[0]) or DEFAULT_DATABASE
            return cls("http", url, database)
        raise ConfigError(f"AREAL_CLICKHOUSE_URL {url!r}: expected chdb:///path or http://user:pass@host:8123/db")


@dataclass(slots=True)
class QueryResult:
    """Columns, their ClickHouse types, rows (tuples). Unpacks as `columns, rows = result`."""

    columns: list[str]
    rows: list[tuple[Any, ...]]
    types: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Any]:
        yield self.columns
        yield self.rows


_DRIVER_PREFIX = re.compile(r"^.*?server response: ")
_DRIVER_TRAILERS = re.compile(r"( \(version [^)]*\))?( \(for url [^)]*\))?$")


def store_message(exc: BaseException) -> str:
    """ClickHouse's message without the driver's wrapping and trailers, on one line (`one_line`)."""
    text = " ".join(str(exc).split())
    if "server response: Code:" in text:
        text = _DRIVER_TRAILERS.sub("", _DRIVER_PREFIX.sub("", text, count=1))
    for junk in (" FORMAT Native", " FORMAT TabSeparatedWithNames"):
        text = text.replace(junk, "")
    return one_line(text)


def unreachable(exc: BaseException) -> bool:
    """True when `exc` says the store did not answer (no connection, a connection lost, retries spent),
    not that it refused what it was asked: an OSError, or the driver's OperationalError."""
    return isinstance(exc, OSError) or any(
        c.__name__ == "OperationalError" and c.__module__.startswith("clickhouse_connect") for c in type(exc).__mro__)


def store_error(exc: BaseException, context: str = "") -> StoreError:
    """The StoreError of a driver's exception: StoreUnavailable when the store did not answer, else QueryError."""
    message = f"{context}: {store_message(exc)}" if context else store_message(exc)
    return StoreUnavailable(message) if unreachable(exc) else QueryError(message)


# ------------------------------------------------------------- direct clients


PING_TIMEOUT_S = 10.0  # a server that accepts and does not answer /ping in this long is taken as away


def _answers(url: ParseResult, timeout_s: float) -> None:
    """TimeoutError when the server at `url` accepts a connection and does not answer /ping within
    `timeout_s`: the driver's first query would wait its read timeout (300 s) before saying so. Any
    other failure (refused, TLS, a status) is left to the driver, which says it in its own words."""
    import http.client
    import ssl

    port = url.port or (8443 if url.scheme == "https" else 8123)
    conn: http.client.HTTPConnection = (
        http.client.HTTPSConnection(url.hostname or "", port, timeout=timeout_s,
                                    context=ssl._create_unverified_context())  # only whether it answers
        if url.scheme == "https" else http.client.HTTPConnection(url.hostname or "", port, timeout=timeout_s))
    try:
        conn.request("GET", "/ping")
        conn.getresponse().read(64)
    except TimeoutError:
        raise TimeoutError(f"no answer to /ping within {timeout_s:g} s") from None
    except Exception:  # noqa: BLE001 - see above
        pass
    finally:
        conn.close()


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
    _answers(parsed, PING_TIMEOUT_S)
    client = clickhouse_connect.get_client(dsn=parsed._replace(path="").geturl(), settings=settings)
    if database:
        client.database = database
    return client


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
            raise store_error(exc) from None
        types = [t.name for t in r.column_types]
        return QueryResult(list(r.column_names), [tuple(row) for row in r.result_rows], types)

    def command(self, sql: str, parameters: Mapping[str, Any] | None = None) -> Any:
        try:
            return self.client.command(sql, parameters=parameters)
        except Exception as exc:  # noqa: BLE001
            raise store_error(exc) from None

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> DirectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------- the holder's ClickHouse endpoint


@dataclass(frozen=True, slots=True)
class StoreUser:
    """A user of the holder's ClickHouse HTTP endpoint."""

    name: str
    password: str
    readonly: bool


@dataclass(frozen=True, slots=True)
class Owner:
    """The process holding a chdb directory, as its owner.json records it."""

    pid: int
    port: int
    database: str
    users: dict[str, StoreUser]  # "reader", "writer"

    def user(self, *, write: bool) -> StoreUser:
        return self.users["writer" if write else "reader"]

    def dsn(self, *, write: bool = False) -> str:
        """http://USER:PASSWORD@127.0.0.1:PORT/DATABASE (read-only unless write)."""
        user = self.user(write=write)
        return f"http://{user.name}:{user.password}@127.0.0.1:{self.port}/{self.database}"

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "port": self.port, "database": self.database,
                "users": {role: {"user": u.name, "password": u.password, "readonly": u.readonly}
                          for role, u in self.users.items()}}

    @classmethod
    def from_json(cls, info: Mapping[str, Any]) -> Owner:
        users = {str(role): StoreUser(str(u["user"]), str(u["password"]), bool(u["readonly"]))
                 for role, u in info["users"].items()}
        if set(users) != {"reader", "writer"}:
            raise ValueError("owner.json must name a reader and a writer")
        return cls(int(info["pid"]), int(info["port"]), str(info["database"]), users)


def read_owner(path: Path) -> Owner | None:
    """The live owner of a chdb directory, from <path>/owner.json; None when nobody holds it."""
    try:
        owner = Owner.from_json(json.loads((path / OWNER_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
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


def owner_client(owner: Owner, *, write: bool) -> Any:
    """A clickhouse-connect HTTP client of the holder's endpoint (no compression: it is loopback)."""
    import clickhouse_connect

    user = owner.user(write=write)
    return clickhouse_connect.get_client(host="127.0.0.1", port=owner.port, username=user.name,
                                         password=user.password, database=owner.database, compress=False,
                                         send_receive_timeout=3600)


def http_dsn(settings: Settings) -> str | None:
    """The read-only ClickHouse HTTP DSN of the configured store: the server's URL, or the holder's endpoint."""
    target = Target.parse(settings.clickhouse_url)
    if target.kind == "http":
        return target.url
    assert target.path is not None
    owner = read_owner(target.path)
    return owner.dsn() if owner is not None else None


Store = DirectStore


def _check_folder(path: Path, write: bool) -> None:
    """ConfigError (exit 2, at once) for a store folder no wait can open: a file where it or a folder
    above it should be, or, to make it, a folder above it this user cannot write."""
    found = next((p for p in (path, *path.parents) if p.exists()), None)
    if found is not None and not found.is_dir():
        raise ConfigError(f"AREAL_CLICKHOUSE_URL chdb://{path}: {found} is a file, not a folder")
    if write and found is not None and found != path and not os.access(found, os.W_OK | os.X_OK):
        raise ConfigError(f"AREAL_CLICKHOUSE_URL chdb://{path}: cannot make it in {found} (not writable)")


def connect(settings: Settings | None = None, *, write: bool = False, wait_s: float = 10.0) -> Store:
    """Open the configured store for queries (see the module docstring).

    Raises ConfigError for a URL that cannot work, StoreUnavailable when the store does not answer,
    QueryError when a server answers and refuses (a user or database it does not know)."""
    settings = settings or Settings.from_env()
    target = Target.parse(settings.clickhouse_url)
    if target.kind == "http":
        try:
            return DirectStore(target, open_client(target, readonly=not write), write=write)
        except ImportError:  # the driver is not installed: not a store that does not answer (the CLI names the extra)
            raise
        except Exception as exc:  # noqa: BLE001
            where = target.url.split("@")[-1]
            raise store_error(exc, f"cannot reach ClickHouse at {where}" if unreachable(exc)
                              else f"ClickHouse at {where} refused the session") from None
    assert target.path is not None
    _check_folder(target.path, write)
    deadline = time.monotonic() + wait_s
    while True:
        owner = read_owner(target.path)
        if owner is not None:
            try:
                return DirectStore(target, owner_client(owner, write=write), write=write)
            except ImportError:
                raise
            except Exception as exc:  # noqa: BLE001
                raise StoreUnavailable(f"the sink holding {target.path} (pid {owner.pid}) did not answer on "
                                 f"127.0.0.1:{owner.port}: {store_message(exc)}") from None
        if not write and not target.path.exists():  # a reader does not make a store: wait for the sink's
            if time.monotonic() > deadline:
                raise StoreUnavailable(f"no ClickHouse store at {target.path} yet: `areal-metrics up` starts one "
                                       "(or set AREAL_CLICKHOUSE_URL)")
            time.sleep(0.2)
            continue
        try:
            return DirectStore(target, open_client(target, readonly=not write), write=write)
        except ImportError:  # the driver is not installed: not a store that does not answer (the CLI names the extra)
            raise
        except Exception as exc:  # noqa: BLE001 - locked by a process that has not published its endpoint yet
            if time.monotonic() > deadline:
                raise StoreUnavailable(f"cannot open the ClickHouse store {target.path}: {store_message(exc)}") from None
            time.sleep(0.2)
