"""The ClickHouse HTTP interface of the process that holds an embedded (chdb) store.

chdb lets one process open a data directory. The sink holds it while the
stack runs, and serves it here, on 127.0.0.1 only, in the subset of
ClickHouse's HTTP interface that clickhouse-connect and clickhouse-go v2 (the
driver in Grafana's ClickHouse data source) speak; `areal_metrics.sinks.http.protocol`
parses the requests, `areal_metrics.sinks.http.native` lays out Native for the client's revision.

Two users with random passwords, recorded in `<store>/owner.json` (mode 0600) while
the endpoint serves, and kept with its port in `<store>/endpoint.json` (0600), so
that a restarted sink serves the same DSN (a Grafana data source keeps working;
another port only when the old one is taken):
`reader` (every session runs with `readonly=1` after the URL's settings are
applied: no INSERT, DDL, SYSTEM, table functions reading files or URLs, or
settings changed by the statement; ClickHouse's error 164) and `writer`
(everything; a GET request runs with `readonly=2`, as in ClickHouse).

Each request gets its own chdb session (a fresh connection handle to the
engine, ~0.1 ms), so `SET`, `USE` and the readonly lock never leak between
requests; at most `max_concurrent` statements run at once, the others wait.

The sink ingests in this process, so a reader's query is bounded (`QueryLimits`, from the
AREAL_HTTP_* settings): a time limit (`max_execution_time`) and a memory limit
(`max_memory_usage`), set after the URL's settings (a URL may ask for less, never more) and
locked by `readonly = 1`; at most `max_reader_queries` reader queries run at once, and one
past that waits `reader_queue_s`, then fails with TOO_MANY_SIMULTANEOUS_QUERIES. While a
statement runs, a watcher checks its client's socket every 0.2 s; when the client has gone,
the statement is killed (KILL QUERY by the session's `log_comment`), not run to its end.
Results are buffered before the first byte is sent, so an error always
arrives as an HTTP error status with ClickHouse's text and the
`X-ClickHouse-Exception-Code` header, never in the middle of a body.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from areal_metrics.sinks.http import protocol as proto
from areal_metrics.sinks.http.protocol import ClickHouseError, Request
from areal_metrics.sinks.http.native import UnsupportedType, for_revision
from areal_metrics.sinks.query import OWNER_FILE, Owner, StoreUser

log = logging.getLogger("areal.sink.http")
READER, WRITER = "reader", "writer"
ENDPOINT_FILE = "endpoint.json"  # the users and port of the store's last endpoint, kept across restarts
_PYTHON_ONLY_FORMATS = {"dataframe", "datastore", "arrowtable"}  # chdb's Python wrappers, not ClickHouse formats


@dataclass(frozen=True, slots=True)
class Answer:
    body: bytes
    fmt: str | None  # X-ClickHouse-Format; None for a statement without a result
    summary: dict[str, str]


@dataclass(frozen=True, slots=True)
class QueryLimits:
    """The bounds of a `reader` query (the AREAL_HTTP_* settings; their defaults here)."""

    timeout_s: float = 30.0  # max_execution_time
    memory_bytes: int = 1 << 30  # max_memory_usage
    max_reader_queries: int = 8  # running at once
    reader_queue_s: float = 10.0  # how long one past that waits for a slot

    @classmethod
    def from_settings(cls, settings: Any) -> QueryLimits:
        """From the sink's settings (sinks/settings.py: SinkSettings)."""
        return cls(settings.http_query_timeout_s, settings.http_query_memory_bytes,
                   settings.http_max_reader_queries, settings.http_reader_queue_s)

    def session_settings(self, asked: dict[str, str]) -> dict[str, str]:
        """The limits to SET for a reader: each unless the URL asked for a tighter one."""
        out = {}
        for name, bound in (("max_execution_time", self.timeout_s), ("max_memory_usage", self.memory_bytes)):
            try:
                given = float(asked.get(name, ""))
            except ValueError:
                given = 0.0
            if not 0 < given <= bound:
                out[name] = f"{bound:g}" if isinstance(bound, float) else str(bound)
        return out


_WATCH_S = 0.2  # how often a running statement's client socket is checked
_TIMEOUT_EXCEEDED, _QUERY_WAS_CANCELLED = 159, 394


def peer_closed(sock: socket.socket) -> bool:
    """Has the other end of `sock` closed it (or reset it)? Never blocks, never consumes data.

    Only an end of stream or a reset says so: any other error (a socket this side cannot
    poll) says nothing about the client, and a live client's statement is never killed for it.
    `poll`, not `select`: `select` cannot take a descriptor past 1023, which a long-lived sink
    holding a store's many open parts reaches (it raised ValueError, taken for a gone client:
    a legitimate query was killed in pending state, QUERY_WAS_CANCELLED)."""
    try:
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLRDHUP if hasattr(select, "POLLRDHUP") else select.POLLIN)
        events = poller.poll(0)
    except (OSError, ValueError):
        return False
    if not events:
        return False
    _, mask = events[0]
    if mask & (select.POLLHUP | select.POLLERR):
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError, TimeoutError):
        return False
    except (ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
        return True
    except (OSError, ValueError):
        return False


def generated_users() -> dict[str, StoreUser]:
    return {READER: StoreUser(READER, secrets.token_urlsafe(18), readonly=True),
            WRITER: StoreUser(WRITER, secrets.token_urlsafe(18), readonly=False)}


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# chdb names the statement it ran: for ours, `In scope SELECT formatQuerySingleLine('<the user's SQL>')`
_TAGGED = re.compile(r"(.*?)[.\s]*(\(\w+\))?\s*", re.S)  # a message, then ClickHouse's (ERROR_NAME)
_WRAPPER = re.compile(r"[:.]?\s*In scope SELECT formatQuerySingleLine\(.*\)(?=\.?\s*(?:\(\w+\))?\s*$)", re.S)


def _canonical(conn: Any, sql: str, user: str) -> str:
    """The statement on one line (`formatQuerySingleLine`), which also parses it; a syntax error names the
    user's SQL, not our wrapper around it."""
    try:
        return conn.query(f"SELECT formatQuerySingleLine({_quote(sql)})", "RawBLOB").bytes().decode()  # type: ignore[no-any-return]
    except Exception as exc:  # noqa: BLE001 - chdb's errors carry ClickHouse's code and text
        err = ClickHouseError.from_engine(exc, user)
        shown = " ".join(sql.split())
        shown = shown if len(shown) <= 300 else shown[:300] + "..."
        message, found = _WRAPPER.subn("", err.message)
        if found:
            body, tag = _TAGGED.fullmatch(message).groups()  # type: ignore[union-attr]
            err.message = f"{body}: in query: {shown}" + (f" {tag}" if tag else "")
        raise err from None


def _identifier(name: str) -> str:
    return "`" + name.replace("\\", "\\\\").replace("`", "\\`") + "`"


class ClickHouseHTTPServer:
    """Serves a chdb data directory over ClickHouse's HTTP interface until `close()`."""

    def __init__(self, path: Path, database: str, *, users: dict[str, StoreUser] | None = None,
                 port: int = 0, max_concurrent: int = 8, limits: QueryLimits = QueryLimits()) -> None:
        import chdb

        self.path = Path(path)
        self.database = database
        kept = _kept_endpoint(self.path) if users is None else None
        self.users = users or (kept.users if kept else generated_users())
        self._by_name = {u.name: u for u in self.users.values()}
        self._connect = lambda: chdb.connect(str(self.path))
        self._slots = threading.BoundedSemaphore(max_concurrent)
        self.limits = limits
        self._readers = threading.BoundedSemaphore(limits.max_reader_queries)
        self.stats = {"killed": 0, "refused": 0}  # statements cancelled for a gone client; readers refused a slot
        self._killed: set[str] = set()  # the tags of statements killed because their client went away
        self.version, self.timezone, self.display_name = self._hello()
        self._server = self._bind(port or (kept.port if kept else 0), fall_back=port == 0)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="clickhouse-http", daemon=True)
        self._thread.start()
        log.info("ClickHouse HTTP interface of %s on 127.0.0.1:%d", self.path, self.port)

    def _bind(self, port: int, *, fall_back: bool) -> ThreadingHTTPServer:
        try:
            return ThreadingHTTPServer(("127.0.0.1", port), _handler_class(self))
        except OSError:
            if not fall_back or port == 0:
                raise
            log.info("the endpoint's last port %d is taken; serving on another", port)
            return ThreadingHTTPServer(("127.0.0.1", 0), _handler_class(self))

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def dsn(self, role: str = READER) -> str:
        user = self.users[role]
        return f"http://{user.name}:{user.password}@127.0.0.1:{self.port}/{self.database}"

    def _hello(self) -> tuple[str, str, str]:
        conn = self._connect()
        try:
            version, tz, name = conn.query("SELECT version(), timezone(), displayName()", "TabSeparated").bytes().decode().split("\t")
        finally:
            conn.close()
        return version, tz, name.strip()

    # ---------------------------------------------------------------- the core

    def authenticate(self, name: str, password: str) -> StoreUser:
        user = self._by_name.get(name)
        if user is None or not secrets.compare_digest(user.password.encode(), password.encode()):
            raise proto.auth_failed(name)
        return user

    def execute(self, user: StoreUser, req: Request, method: str,
                client_gone: Callable[[], bool] | None = None) -> Answer:
        """Run one statement in a session of its own; raises ClickHouseError. `client_gone`:
        True once the client has gone away (the statement is then killed)."""
        if user.readonly and not self._readers.acquire(timeout=self.limits.reader_queue_s):
            self.stats["refused"] += 1
            raise ClickHouseError(
                proto.TOO_MANY_SIMULTANEOUS_QUERIES,
                f"Too many simultaneous queries: the {user.name} user runs at most {self.limits.max_reader_queries} "
                f"at once (AREAL_HTTP_MAX_READER_QUERIES); none finished within {self.limits.reader_queue_s:g} s",
                "TOO_MANY_SIMULTANEOUS_QUERIES")
        try:
            return self._execute(user, req, method, client_gone)
        finally:
            if user.readonly:
                self._readers.release()

    def _execute(self, user: StoreUser, req: Request, method: str, client_gone: Callable[[], bool] | None) -> Answer:
        with self._slots:
            conn = self._connect()
            tag = f"areal-http:{uuid.uuid4().hex}"
            try:
                self._prepare(conn, user, req, method, tag)
                if req.insert_format is not None:
                    return self._insert(conn, req)
                canonical = _canonical(conn, req.sql, user.name)
                proto.check_statement(canonical, readonly=user.readonly)
                out_fmt = proto.output_format(canonical, req.default_format)
                if req.default_format.lower() in _PYTHON_ONLY_FORMATS or out_fmt.lower() in _PYTHON_ONLY_FORMATS:
                    raise ClickHouseError(proto.UNKNOWN_FORMAT, f"Unknown format {out_fmt}", "UNKNOWN_FORMAT")
                started = time.monotonic()
                with self._watching(tag, client_gone):
                    result = conn.query(req.sql, req.default_format, params=req.parameters)
                body = result.bytes() or b""
                elapsed = time.monotonic() - started
            except ClickHouseError:
                raise
            except Exception as exc:  # noqa: BLE001 - chdb's errors carry ClickHouse's code and text
                raise self._which_bound(ClickHouseError.from_engine(exc, user.name), user, req, tag) from None
            finally:
                self._killed.discard(tag)
                conn.close()
        if out_fmt == "Native" and req.revision > 0:
            try:
                body = b"".join(for_revision(body, req.revision))
            except UnsupportedType as exc:
                raise ClickHouseError(proto.NOT_IMPLEMENTED, str(exc), "NOT_IMPLEMENTED") from None
        summary = {"read_rows": str(result.rows_read()), "read_bytes": str(result.bytes_read()),
                   "written_rows": "0", "written_bytes": "0", "elapsed_ns": str(int(elapsed * 1e9))}
        return Answer(body, out_fmt if proto.returns_rows(canonical) else None, summary)

    def _which_bound(self, err: ClickHouseError, user: StoreUser, req: Request, tag: str) -> ClickHouseError:
        """The engine's error, saying which bound stopped the statement: the reader's time limit, or
        its client leaving (a statement is cancelled for nothing else)."""
        if err.code == _TIMEOUT_EXCEEDED and user.readonly:
            try:
                asked = float(req.settings.get("max_execution_time", ""))
            except ValueError:
                asked = 0.0
            bound = (f"max_execution_time={asked:g} s from the URL" if 0 < asked < self.limits.timeout_s
                     else f"AREAL_HTTP_QUERY_TIMEOUT_S={self.limits.timeout_s:g} s")
            return ClickHouseError(err.code, f"{err.message} (the reader's time bound: {bound})", err.name)
        if err.code == _QUERY_WAS_CANCELLED and tag in self._killed:
            return ClickHouseError(err.code, f"{err.message} (its client went away)", err.name)
        return err

    @contextmanager
    def _watching(self, tag: str, client_gone: Callable[[], bool] | None) -> Iterator[None]:
        """While the block runs, kill the session's statement once `client_gone()` is true."""
        if client_gone is None:
            yield
            return
        done = threading.Event()

        def watch() -> None:
            while not done.wait(_WATCH_S):
                if client_gone():
                    self.stats["killed"] += 1
                    self._killed.add(tag)
                    self._kill(tag)
                    return

        threading.Thread(target=watch, name="clickhouse-http-watch", daemon=True).start()
        try:
            yield
        finally:
            done.set()

    def _kill(self, tag: str) -> None:
        conn = self._connect()
        try:
            conn.query(f"KILL QUERY WHERE Settings['log_comment'] = {_quote(tag)} SYNC")
            log.info("ClickHouse HTTP: the client went away; its statement was killed")
        except Exception as exc:  # noqa: BLE001 - it may have finished meanwhile
            log.debug("ClickHouse HTTP: kill: %s", exc)
        finally:
            conn.close()

    def _prepare(self, conn: Any, user: StoreUser, req: Request, method: str, tag: str) -> None:
        """The session: the URL's settings, the reader's bounds and readonly lock, the database.
        `tag` goes into `log_comment`: what a kill finds the statement by."""
        if method == "GET" and not user.readonly:
            conn.query("SET readonly = 2")  # as in ClickHouse, before the URL's settings: GET only reads
        for name, value in req.settings.items():
            if name == "readonly" and user.readonly:
                if value.strip() in ("0", ""):
                    raise ClickHouseError(proto.READONLY, "Cannot modify 'readonly' setting in readonly mode", "READONLY")
                continue  # 1 or 2: the lock below is at least as strict
            conn.query(f"SET {name} = {_quote(value)}")
        conn.query(f"SET log_comment = {_quote(tag)}")
        if user.readonly:
            for name, value in self.limits.session_settings(req.settings).items():
                conn.query(f"SET {name} = {value}")
            conn.query("SET readonly = 1")
        conn.query(f"USE {_identifier(req.database or self.database)}")

    def _insert(self, conn: Any, req: Request) -> Answer:
        started = time.monotonic()
        with conn.send_insert(req.sql, req.insert_format) as inserter:
            if req.data:
                inserter.append(req.data)
            done = inserter.finish()
        summary = {"read_rows": "0", "read_bytes": "0", "written_rows": str(done.rows_written),
                   "written_bytes": str(done.bytes_written), "elapsed_ns": str(int((time.monotonic() - started) * 1e9))}
        return Answer(b"", None, summary)

    # --------------------------------------------------------------- lifecycle

    def publish(self) -> Path:
        """Write owner.json (mode 0600) in the store: pid, port, database and the users' passwords."""
        owner = Owner(os.getpid(), self.port, self.database, dict(self.users))
        _write_private(self.path / ENDPOINT_FILE, owner.to_json())
        return _write_private(self.path / OWNER_FILE, owner.to_json())

    def close(self) -> None:
        path = self.path / OWNER_FILE
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass
        self._server.shutdown()
        self._server.server_close()


def _write_private(path: Path, data: dict[str, Any]) -> Path:
    """JSON that holds passwords: written whole (rename) and readable by this user only."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
    return path


def _kept_endpoint(path: Path) -> Owner | None:
    """The users and port a previous endpoint of this store served (None: make new ones)."""
    try:
        kept = Owner.from_json(json.loads((path / ENDPOINT_FILE).read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not all(len(u.password) >= 16 for u in kept.users.values()) or not 0 < kept.port < 65536:
        return None
    users = {READER: StoreUser(READER, kept.users[READER].password, readonly=True),  # the roles as made here
             WRITER: StoreUser(WRITER, kept.users[WRITER].password, readonly=False)}
    return Owner(kept.pid, kept.port, kept.database, users)


# ----------------------------------------------------------------- the shell


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            parts.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def _handler_class(server: ClickHouseHTTPServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: clients pool their connections
        disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms wait for a delayed ACK
        server_version = "ClickHouse"
        sys_version = ""

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_HEAD(self) -> None:
            self._send(200, b"", {"Content-Type": "text/html; charset=UTF-8"}, head=True)

        def _serve(self, method: str) -> None:
            url = urlsplit(self.path)
            params = dict(parse_qsl(url.query, keep_blank_values=True))
            if url.path.rstrip("/") == f"/{server.database}":  # the DSN's path names its database (curl "$DSN")
                url = url._replace(path="/")
                params.setdefault("database", server.database)
            if method == "GET" and (url.path in ("/ping", "/replicas_status") or (url.path == "/" and "query" not in params)):
                self._send(200, b"Ok.\n", {"Content-Type": "text/html; charset=UTF-8"})
                return
            query_id, body_read = "", method != "POST"
            try:
                if url.path != "/":
                    raise ClickHouseError(proto.BAD_ARGUMENTS, f"There is no handle {url.path}")
                user = server.authenticate(*proto.credentials(self.headers, params))  # before reading any body
                body = _read_body(self) if method == "POST" else b""
                body_read = True
                if self.headers.get("Content-Type", "").startswith("multipart/form-data"):
                    raise ClickHouseError(proto.NOT_IMPLEMENTED, "external data (multipart/form-data) is not supported here")
                req = proto.parse_request(params, proto.decode(body, self.headers.get("Content-Encoding", "")), self.headers)
                query_id = req.query_id or str(uuid.uuid4())
                answer = server.execute(user, req, method, lambda: peer_closed(self.connection))
            except Exception as exc:
                if not isinstance(exc, ClickHouseError):
                    log.exception("ClickHouse HTTP request failed")
                    exc = ClickHouseError(proto.UNKNOWN_EXCEPTION, f"{type(exc).__name__}: {exc}")
                self.close_connection = not body_read  # an unread body would be taken for the next request
                self._error(exc, query_id)
                return
            encoding = proto.response_encoding(self.headers.get("Accept-Encoding", ""),
                                               params.get("enable_http_compression", "0") in ("1", "true"))
            headers = {"Content-Type": proto.content_type(answer.fmt or "TabSeparated"),
                       "X-ClickHouse-Query-Id": query_id, "X-ClickHouse-Summary": json.dumps(answer.summary)}
            if answer.fmt:
                headers["X-ClickHouse-Format"] = answer.fmt
            if encoding:
                headers["Content-Encoding"] = encoding
            self._send(200, proto.encode(answer.body, encoding), headers)

        def _error(self, err: ClickHouseError, query_id: str) -> None:
            headers = {"Content-Type": "text/plain; charset=UTF-8", "X-ClickHouse-Exception-Code": str(err.code)}
            if query_id:
                headers["X-ClickHouse-Query-Id"] = query_id
            if err.code == proto.AUTHENTICATION_FAILED:
                log.warning("ClickHouse HTTP: %s", err.message)
            self._send(proto.http_status(err.code), proto.error_body(err, server.version), headers)

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool = False) -> None:
            self.send_response(status)
            for name, value in {**headers, "X-ClickHouse-Server-Display-Name": server.display_name,
                                "X-ClickHouse-Timezone": server.timezone, "Content-Length": str(len(body))}.items():
                self.send_header(name, value)
            try:
                self.end_headers()
                if not head:
                    self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the client went away
                self.close_connection = True

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("ClickHouse HTTP: " + format, *args)

    return Handler
