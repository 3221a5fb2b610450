"""A reader's query over the sink's HTTP endpoint is bounded: in time, in memory, in how many
run at once, and it stops when its client goes away. The real engine (chdb), no broker.

No wall-clock bound is asserted beyond generous liveness timeouts; the figures (how soon a
killed query's CPU is back to idle) are measured by benchmarks/bench_http_bounds.py.
"""

from __future__ import annotations

import base64
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.sinks.http.server import ClickHouseHTTPServer, QueryLimits
from areal_metrics.sinks.settings import SinkSettings
from tests.test_clickhouse_http import Served

HEAVY = "SELECT count() FROM numbers(100000000000) WHERE number % 7 = 3"  # minutes of a core, no memory
HUGE = "SELECT length(groupArray(number)) FROM numbers(1000000000)"  # would hold 8 GB


def serve(path: Path, limits: QueryLimits) -> Iterator[Served]:
    server = ClickHouseHTTPServer(path, "default", limits=limits)
    try:
        yield Served(server)
    finally:
        server.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    yield from serve(tmp_path, QueryLimits(timeout_s=2, max_reader_queries=1, reader_queue_s=0.5))


def code(response) -> int:
    return int(response.getheader("X-ClickHouse-Exception-Code") or 0)


def running(served: Served, sql: str) -> int:
    """Statements of `sql` the engine is running (asked as the writer, which has no bound)."""
    quoted = sql.replace("'", "\\'")
    r = served.http({"query": f"SELECT count() FROM system.processes WHERE query = '{quoted}'"}, role="writer")
    return int(r.data)


def wait_for(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_readers_query_stops_at_its_time_limit_even_when_the_url_asks_for_none(served: Served) -> None:
    r = served.http({"query": HEAVY, "max_execution_time": "0"})
    assert r.status == 408 and code(r) == 159, r.data  # TIMEOUT_EXCEEDED
    assert b"maximum: 2" in r.data and b"(the reader's time bound: AREAL_HTTP_QUERY_TIMEOUT_S=2 s)" in r.data
    assert served.http({"query": "SELECT 1"}).data == b"1\n"


def test_the_url_may_ask_a_reader_for_a_tighter_time_limit(served: Served) -> None:
    r = served.http({"query": HEAVY, "max_execution_time": "0.5"})
    assert code(r) == 159 and b"maximum: 500" in r.data, r.data
    assert b"(the reader's time bound: max_execution_time=0.5 s from the URL)" in r.data


def test_a_readers_query_that_would_hold_gigabytes_fails_with_the_memory_limit_and_the_server_stays_up(
        tmp_path: Path) -> None:
    for s in serve(tmp_path, QueryLimits()):  # the documented defaults
        r = s.http({"query": HUGE})
        assert code(r) == 241, r.data  # MEMORY_LIMIT_EXCEEDED
        assert b"memory limit exceeded" in r.data.lower()
        assert s.http({"query": "SELECT 1"}).data == b"1\n"


def _send_held(served: Served, sql: str) -> socket.socket:
    """Send a reader's `sql` on a raw connection and leave it open: the statement runs until the
    socket is closed (or its own limit)."""
    auth = base64.b64encode(f"{served.reader.name}:{served.reader.password}".encode()).decode()
    sock = socket.create_connection(("127.0.0.1", served.port))
    sock.sendall(f"GET /?{urllib.parse.urlencode({'query': sql})} HTTP/1.1\r\nHost: x\r\n"
                 f"Authorization: Basic {auth}\r\n\r\n".encode())
    return sock


def test_a_query_whose_client_went_away_is_killed(tmp_path: Path) -> None:
    for s in serve(tmp_path, QueryLimits(timeout_s=600)):
        sock = _send_held(s, HEAVY)
        wait_for(lambda: running(s, HEAVY) == 1, 60, "the heavy query to start")
        sock.close()  # the client gives up
        wait_for(lambda: running(s, HEAVY) == 0, 60, "the abandoned query to stop")
        assert s.server.stats["killed"] == 1
        assert s.http({"query": "SELECT 1"}).data == b"1\n"


def test_a_reader_query_past_the_bound_fails_with_a_clear_error(tmp_path: Path) -> None:
    # The first query holds the one slot until its client goes away (no time limit in reach), so
    # however loaded the machine, the second one finds the slot taken.
    for served in serve(tmp_path, QueryLimits(timeout_s=600, max_reader_queries=1, reader_queue_s=0.5)):
        held = _send_held(served, HEAVY)
        wait_for(lambda: running(served, HEAVY) == 1, 60, "the first query to run")  # the writer is not bound
        r = served.http({"query": "SELECT 1"})
        assert r.status == 503 and code(r) == 202, r.data  # TOO_MANY_SIMULTANEOUS_QUERIES
        assert b"runs at most 1 at once (AREAL_HTTP_MAX_READER_QUERIES)" in r.data
        assert served.server.stats["refused"] == 1
        held.close()  # its client gives up: killed, and the slot is free again
        wait_for(lambda: running(served, HEAVY) == 0, 60, "the first query to stop")
        wait_for(lambda: served.http({"query": "SELECT 1"}).data == b"1\n", 60, "a reader's slot")
        assert served.http({"query": "SELECT 1"}, role="writer").data == b"1\n"


def test_the_limits_are_settings_with_documented_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = SinkSettings.from_env()
    assert (defaults.http_query_timeout_s, defaults.http_query_memory_bytes, defaults.http_max_reader_queries,
            defaults.http_reader_queue_s) == (30.0, 1 << 30, 8, 10.0)
    assert QueryLimits.from_settings(defaults) == QueryLimits()
    monkeypatch.setenv("AREAL_HTTP_QUERY_TIMEOUT_S", "5")
    monkeypatch.setenv("AREAL_HTTP_MAX_READER_QUERIES", "2")
    assert QueryLimits.from_settings(SinkSettings.from_env()) == QueryLimits(timeout_s=5.0, max_reader_queries=2)
    monkeypatch.setenv("AREAL_HTTP_QUERY_MEMORY_BYTES", "0")
    with pytest.raises(ConfigError, match="AREAL_HTTP_QUERY_MEMORY_BYTES='0'"):
        SinkSettings.from_env()


def test_a_live_clients_query_is_never_killed_when_its_socket_is_past_descriptor_1023(tmp_path: Path) -> None:
    """A sink holds many files of its store open: the connection of a query got a descriptor
    past 1023, which `select` cannot take; its ValueError was read as "the client went away" and
    the statement was killed in pending state (QUERY_WAS_CANCELLED), on a loaded machine in the
    full suite. Only a client that closed its socket, or the query's own bound, stops a query."""
    import os
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip(f"needs 1200 open files (limit {soft})")
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100 - len(os.listdir("/proc/self/fd")))]
    try:
        for s in serve(tmp_path, QueryLimits(timeout_s=600)):
            sql = "SELECT sum(sleepEachRow(0.1)) FROM numbers(10)"  # a second or more, in blocks of one row
            r = s.http({"query": sql, "max_block_size": "1"})
            assert r.status == 200 and r.data == b"0\n", r.data
            assert s.server.stats["killed"] == 0
            sock = _send_held(s, HEAVY)  # and a client that leaves is still seen to leave
            wait_for(lambda: running(s, HEAVY) == 1, 60, "the heavy query to start")
            sock.close()
            wait_for(lambda: running(s, HEAVY) == 0, 60, "the abandoned query to stop")
            assert s.server.stats["killed"] == 1
    finally:
        for fd in filler:
            os.close(fd)
