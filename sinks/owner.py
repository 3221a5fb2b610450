"""The loopback query endpoint of the process that holds a chdb directory.

chdb lets one process open a data directory. The sink holds it while the stack
runs, so it also answers the CLI's queries (`areal-metrics sql`, `report`,
`replay`) here: POST /query, /command, /replay with a JSON body, on 127.0.0.1
only, guarded by a random token that `owner.json` (mode 0600) records beside
the port. `sinks.query.connect` is the client.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from sinks.query import OWNER_FILE, DirectStore, StoreError, Target, encode_value, open_client

log = logging.getLogger(__name__)


class OwnerEndpoint:
    """Serves queries against the directory this process holds; `close()` removes owner.json."""

    def __init__(self, target: Target, replay: Callable[[bool], dict[str, Any]] | None = None) -> None:
        assert target.path is not None
        self.target = target
        self.token = secrets.token_hex(16)
        self._replay = replay
        self._replay_lock = threading.Lock()
        # two handles on the engine: readonly is session state chdb cannot undo
        self._stores = {
            False: DirectStore(target, open_client(target, readonly=True), write=False),
            True: DirectStore(target, open_client(target, readonly=False), write=True),
        }
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="owner-endpoint", daemon=True)
        self._thread.start()
        self._write_owner_file()

    @property
    def write_client(self) -> Any:
        """The clickhouse-connect client of the writable handle (for replay)."""
        return self._stores[True].client

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _write_owner_file(self) -> None:
        path = self.target.path / OWNER_FILE  # type: ignore[operator]
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"pid": os.getpid(), "port": self.port, "token": self.token}, f)
        os.replace(tmp, path)

    def handle(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if op == "replay":
            if self._replay is None:
                raise StoreError("this process cannot replay")
            if not self._replay_lock.acquire(blocking=False):
                raise StoreError("a replay is already running")
            try:
                return {"result": self._replay(bool(body.get("force")))}
            except Exception as exc:  # noqa: BLE001 - ReplayRefused, Kafka errors: one line to the CLI
                raise StoreError(" ".join(str(exc).split()) or type(exc).__name__) from None
            finally:
                self._replay_lock.release()
        sql = body.get("sql")
        if not isinstance(sql, str):
            raise StoreError("the request has no 'sql' string")
        store = self._stores[bool(body.get("write"))]
        params = body.get("parameters") or None
        if op == "query":
            r = store.query(sql, params)
            return {"columns": r.columns, "types": r.types, "rows": [encode_value(list(row)) for row in r.rows]}
        if op == "command":
            return {"result": encode_value(store.command(sql, params))}
        raise StoreError(f"unknown operation {op!r}")

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                if self.headers.get("X-Areal-Token") != endpoint.token:
                    self._reply(403, {"error": "bad token"})
                    return
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    body = json.loads(self.rfile.read(length) or b"{}")
                    self._reply(200, endpoint.handle(self.path.strip("/"), body))
                except StoreError as exc:
                    self._reply(400, {"error": str(exc)})
                except Exception as exc:  # noqa: BLE001 - the CLI gets one line, the log the rest
                    log.exception("owner endpoint request failed")
                    self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

            def _reply(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload, allow_nan=True).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                log.debug("owner endpoint: " + format, *args)

        return Handler

    def close(self) -> None:
        path: Path = self.target.path / OWNER_FILE  # type: ignore[operator]
        try:
            info = json.loads(path.read_text())
            if info.get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass
        self._server.shutdown()
        self._server.server_close()
        for store in self._stores.values():
            store.close()
