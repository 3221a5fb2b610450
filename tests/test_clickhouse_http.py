"""The holder's ClickHouse HTTP interface, driven by clickhouse-connect and by plain HTTP requests.

A store holding the recorded demo run (tests/data/demo_events.jsonl) is served
by `areal_metrics.sinks.http.server` in this process, as the running sink serves it; the
tests read it the way clickhouse-connect and a ClickHouse server's users do:
each format, query in the URL, the body or both, settings and parameters in
the URL, both users, errors with ClickHouse's codes and statuses, compression,
concurrent clients and a big result. No broker needed.
"""

from __future__ import annotations

import base64
import gzip
import http.client
import json
import threading
import urllib.parse
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import clickhouse_connect
import lz4.frame
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from areal_metrics.sinks.http.protocol import _zstd
from areal_metrics.sinks.http.server import ClickHouseHTTPServer
from tests.test_grafana_data import fixture_events, write_events

STEPS = sum(e.type == "step" for e in fixture_events())


class Served:
    def __init__(self, server: ClickHouseHTTPServer) -> None:
        self.server = server
        self.port = server.port
        self.reader = server.users["reader"]
        self.writer = server.users["writer"]

    def client(self, role: str = "reader", **kwargs: Any) -> Any:
        user = self.server.users[role]
        return clickhouse_connect.get_client(host="127.0.0.1", port=self.port, username=user.name,
                                             password=user.password, database="areal", **kwargs)

    def http(self, params: dict[str, str] | None = None, body: bytes | None = None, *, role: str | None = "reader",
             headers: dict[str, str] | None = None, method: str | None = None, path: str = "/") -> http.client.HTTPResponse:
        """One raw request (basic auth as `role` unless None); the response, body read into .data."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        all_headers = dict(headers or {})
        if role is not None:
            user = self.server.users[role]
            all_headers["Authorization"] = "Basic " + base64.b64encode(f"{user.name}:{user.password}".encode()).decode()
        url = path + ("?" + urllib.parse.urlencode(params) if params else "")
        conn.request(method or ("POST" if body is not None else "GET"), url, body=body, headers=all_headers)
        response = conn.getresponse()
        response.data = response.read()  # type: ignore[attr-defined]
        conn.close()
        return response


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    directory = tmp_path_factory.mktemp("http-store")
    write_events(directory)
    server = ClickHouseHTTPServer(directory, "areal")
    try:
        yield Served(server)
    finally:
        server.close()


def test_a_restarted_endpoint_serves_the_same_dsn_and_another_port_only_when_its_own_is_taken(tmp_path: Path) -> None:
    import socket
    import stat

    write_events(tmp_path)  # a store with the project's tables (database areal)
    first = ClickHouseHTTPServer(tmp_path, "areal")
    first.publish()
    dsn, port = first.dsn("reader"), first.port
    first.close()
    assert stat.S_IMODE((tmp_path / "endpoint.json").stat().st_mode) == 0o600
    assert not (tmp_path / "owner.json").exists()  # gone with its process; the endpoint's users stay

    again = ClickHouseHTTPServer(tmp_path, "areal")
    try:
        assert again.dsn("reader") == dsn and again.dsn("writer") == first.dsn("writer")
        assert again.users["reader"].readonly and not again.users["writer"].readonly
        r = clickhouse_connect.get_client(dsn=dsn).query("SELECT count() > 0 FROM areal.steps")
        assert r.result_rows == [(1,)]
        again.publish()
    finally:
        again.close()

    with socket.socket() as taken:  # the old port is in use: same users, another port
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the closed endpoint's TIME_WAIT
        taken.bind(("127.0.0.1", port))
        taken.listen()
        moved = ClickHouseHTTPServer(tmp_path, "areal")
        try:
            assert moved.port != port and moved.users == again.users
        finally:
            moved.close()

    (tmp_path / "endpoint.json").write_text('{"pid": 1, "port": 5, "database": "areal", "users": '
                                            '{"reader": {"user": "reader", "password": "short", "readonly": false}, '
                                            '"writer": {"user": "writer", "password": "short", "readonly": false}}}')
    fresh = ClickHouseHTTPServer(tmp_path, "areal")  # weak or broken kept users: new ones
    try:
        assert fresh.users["reader"].password != "short" and fresh.users["reader"].readonly
    finally:
        fresh.close()


# ------------------------------------------------------------------ formats


def test_native_through_clickhouse_connect_with_its_protocol_revision(served: Served) -> None:
    client = served.client()
    assert client.protocol_version == 54405  # its probe found the block info it expects for that revision
    r = client.query("SELECT run_id, step, reward, ts, metrics, node FROM areal.steps FINAL ORDER BY run_id, step, rank LIMIT 3")
    assert r.column_names == ("run_id", "step", "reward", "ts", "metrics", "node")
    assert [t.name for t in r.column_types][:4] == ["LowCardinality(String)", "UInt64", "Nullable(Float64)",
                                                   "DateTime64(3, 'UTC')"]
    assert len(r.result_rows) == 3 and r.result_rows[0][0] == "demo-g2" and r.result_rows[0][1] == 1
    assert client.command("SELECT count() FROM areal.steps FINAL") == STEPS
    df = client.query_df("SELECT step, reward FROM areal.v_steps WHERE run_id = 'demo-g4' ORDER BY step, rank")
    assert len(df) == 400 and list(df.columns) == ["step", "reward"]


@pytest.mark.parametrize("fmt", ["RowBinaryWithNamesAndTypes", "JSONEachRow", "TabSeparatedWithNamesAndTypes",
                                 "CSVWithNames", "JSONCompact", "Native", "Parquet", "Arrow", "Values", "Pretty"])
def test_every_format_is_the_engines_own_output(served: Served, fmt: str) -> None:
    """Without a protocol revision, the endpoint passes the engine's bytes through unchanged."""
    import chdb

    sql = "SELECT run_id, step, reward, ts, metrics FROM areal.steps FINAL ORDER BY run_id, step, rank LIMIT 50"
    direct = chdb.connect(str(served.server.path))
    try:
        expected = direct.query(sql, fmt).bytes()
    finally:
        direct.close()
    got = served.client().raw_query(sql, fmt=fmt)
    if fmt == "JSONCompact":  # carries the elapsed time
        got_json, expected_json = json.loads(got), json.loads(expected)
        assert got_json["data"] == expected_json["data"] and got_json["meta"] == expected_json["meta"]
    elif fmt not in ("Parquet", "Arrow"):  # these embed the writer's metadata: compare by reading them
        assert got == expected
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        read = (lambda b: pq.read_table(pa.BufferReader(b))) if fmt == "Parquet" else (
            lambda b: pa.ipc.open_file(pa.BufferReader(b)).read_all())
        assert read(got).equals(read(expected))
    assert len(got) > 100


def test_format_comes_from_the_statement_else_default_format(served: Served) -> None:
    r = served.http({"query": "SELECT 1 AS x", "default_format": "JSONEachRow"})
    assert r.status == 200 and r.data == b'{"x":1}\n' and r.getheader("X-ClickHouse-Format") == "JSONEachRow"
    r = served.http({"query": "SELECT 1 AS x FORMAT CSVWithNames", "default_format": "JSONEachRow"})
    assert r.data == b'"x"\n1\n' and r.getheader("X-ClickHouse-Format") == "CSVWithNames"
    r = served.http({"query": "SELECT 1 AS x"})  # ClickHouse's default: TabSeparated
    assert r.data == b"1\n" and r.getheader("Content-Type").startswith("text/tab-separated-values")
    r = served.http({"query": "SELECT 1 AS x"}, headers={"X-ClickHouse-Format": "JSONEachRow"})
    assert r.data == b'{"x":1}\n'


def test_query_in_the_url_the_body_or_both(served: Served) -> None:
    sql = "SELECT count() FROM areal.steps FINAL WHERE run_id = 'demo-g4'"
    expected = f"{STEPS // 2}\n".encode()
    assert served.http({"query": sql}).data == expected  # GET, URL
    assert served.http(None, sql.encode()).data == expected  # POST, body
    both = served.http({"query": "SELECT count() FROM areal.steps FINAL WHERE "}, b"run_id = 'demo-g4'")
    assert both.status == 200 and both.data == expected  # URL prefix + body, as ClickHouse concatenates them
    assert served.http({"query": "SELECT {n:UInt8} + 1", "param_n": "41"}).data == b"42\n"
    with_db = served.http({"query": "SELECT count() FROM steps FINAL", "database": "areal"})
    assert with_db.data == f"{STEPS}\n".encode()
    assert served.http({"query": "SELECT currentDatabase()"}).data == b"areal\n"  # the store's database by default
    missing = served.http({"query": "SELECT 1", "database": "nope"})
    assert missing.status == 404 and missing.getheader("X-ClickHouse-Exception-Code") == "81"


def test_empty_result_and_statement_headers(served: Served) -> None:
    r = served.http({"query": "SELECT step FROM areal.steps WHERE 0", "default_format": "Native",
                     "client_protocol_version": "54460", "query_id": "my-query"})
    assert r.status == 200 and r.data == b"" and r.getheader("X-ClickHouse-Query-Id") == "my-query"
    summary = json.loads(r.getheader("X-ClickHouse-Summary"))
    assert {"read_rows", "read_bytes", "written_rows", "elapsed_ns"} <= set(summary)
    assert r.getheader("X-ClickHouse-Timezone") and r.getheader("X-ClickHouse-Format") == "Native"
    assert served.client().query("SELECT step FROM areal.steps WHERE 0").result_rows == []


def test_health_answers(served: Served) -> None:
    for path in ("/ping", "/"):
        r = served.http(role=None, path=path)
        assert r.status == 200 and r.data == b"Ok.\n"
    assert served.client().ping()
    assert served.http({"query": "SELECT 1"}, path="/nope").status == 400


# ---------------------------------------------------- settings and sessions


def test_url_settings_reach_the_engine_and_stay_in_their_request(served: Served) -> None:
    r = served.http({"query": "SELECT getSetting('max_execution_time'), getSetting('readonly')", "max_execution_time": "17"})
    assert r.status == 200 and r.data == b"17\t1\n"  # applied, then the reader's lock
    assert served.http({"query": "SELECT getSetting('max_execution_time')"}).data == b"30\n"  # not kept: the reader's bound
    unknown = served.http({"query": "SELECT 1", "no_such_setting": "1"})
    assert unknown.status == 404 and unknown.getheader("X-ClickHouse-Exception-Code") == "115"
    # what clickhouse-connect sends for a session, a query id and its transport is accepted
    transport = {"query": "SELECT 1", "session_id": "s1", "session_timeout": "60", "query_id": "q1",
                 "wait_end_of_query": "1", "send_progress_in_http_headers": "1", "buffer_size": "1000",
                 "cancel_http_readonly_queries_on_client_close": "1", "http_headers_progress_interval_ms": "10000"}
    assert served.http(transport).data == b"1\n"
    settings = served.client("writer").query("SELECT getSetting('max_threads') AS t", settings={"max_threads": 1})
    assert settings.result_rows == [(1,)]


def test_a_setting_cannot_unlock_the_reader(served: Served) -> None:
    r = served.http({"query": "SELECT 1", "readonly": "0"})
    assert r.status == 500 and r.getheader("X-ClickHouse-Exception-Code") == "164"
    r = served.http({"query": "CREATE TABLE areal.x (a UInt8) ENGINE = Memory", "readonly": "2"}, b"")
    assert r.getheader("X-ClickHouse-Exception-Code") == "164"
    r = served.http({"query": "SELECT getSetting('readonly')", "readonly": "2"})
    assert r.data == b"1\n"


# --------------------------------------------------------------- read-only

REFUSED = [
    "CREATE TABLE areal.x (a UInt8) ENGINE = Memory",
    "CREATE DATABASE other",
    "DROP TABLE areal.steps",
    "TRUNCATE TABLE areal.steps",
    "ALTER TABLE areal.steps DELETE WHERE 1",
    "ALTER TABLE areal.steps ADD COLUMN x UInt8",
    "RENAME TABLE areal.steps TO areal.steps2",
    "INSERT INTO areal.steps (event_id, run_id) VALUES ('x', 'y')",
    "INSERT INTO FUNCTION file('/tmp/areal-leak.tsv', 'TSV', 'a UInt8') VALUES (1)",
    "OPTIMIZE TABLE areal.steps FINAL",
    "SYSTEM STOP MERGES areal.steps",
    "DETACH TABLE areal.steps",
    "SELECT * FROM file('/etc/passwd', 'LineAsString')",
    "SELECT * FROM url('http://127.0.0.1:9/x', 'CSV', 'a String')",
    "SELECT 1 SETTINGS readonly = 0",
    "SET readonly = 0",
    "DELETE FROM areal.steps WHERE 1",
    "/* a comment first */ DROP TABLE areal.steps",
]
# refused with another code: what the engine would run but a ClickHouse server refuses
REFUSED_OTHERWISE = {
    "KILL QUERY WHERE 1": 497,  # every engine session is one engine user: a grant in ClickHouse
    "SELECT 1 INTO OUTFILE '/tmp/areal-leak.txt'": 358,  # would write a file in the holder's process
    "SELECT 1; DROP TABLE areal.steps": 62,  # multi-statements are not allowed
    "SELECT 1; SELECT 2": 62,
}


@pytest.mark.parametrize("sql", REFUSED + list(REFUSED_OTHERWISE))
def test_the_reader_cannot_change_anything(served: Served, sql: str) -> None:
    code = REFUSED_OTHERWISE.get(sql, 164)
    r = served.http(None, sql.encode())
    assert r.getheader("X-ClickHouse-Exception-Code") == str(code), r.data
    assert r.status == (400 if code == 62 else 500)
    assert r.data.startswith(f"Code: {code}. DB::Exception: ".encode())
    if code == 164:
        assert b"readonly" in r.data
    with pytest.raises(DatabaseError) as err:
        served.client().command(sql)
    assert err.value.code == code
    assert served.client("writer").command("SELECT count() FROM areal.steps FINAL") == STEPS
    assert not Path("/tmp/areal-leak.txt").exists() and not Path("/tmp/areal-leak.tsv").exists()


def test_the_writer_cannot_write_files_either(served: Served) -> None:
    r = served.http(None, b"SELECT 1 INTO OUTFILE '/tmp/areal-leak.txt'", role="writer")
    assert r.getheader("X-ClickHouse-Exception-Code") == "358" and not Path("/tmp/areal-leak.txt").exists()
    literal = served.http(None, b"SELECT 'INTO OUTFILE' AS a", role="writer")  # only the clause is refused
    assert literal.status == 200 and literal.data == b"INTO OUTFILE\n"


def test_a_get_request_of_the_writer_is_read_only_as_in_clickhouse(served: Served) -> None:
    r = served.http({"query": "CREATE TABLE areal.by_get (a UInt8) ENGINE = Memory"}, role="writer")
    assert r.status == 500 and r.getheader("X-ClickHouse-Exception-Code") == "164"
    assert served.http({"query": "SELECT getSetting('readonly')"}, role="writer").data == b"2\n"
    unlock = served.http({"query": "SELECT 1", "readonly": "0"}, role="writer")
    assert unlock.getheader("X-ClickHouse-Exception-Code") == "164"  # a GET cannot lift it either
    assert served.http(None, b"SELECT getSetting('readonly')", role="writer").data == b"0\n"  # POST: not read-only


# ----------------------------------------------------------------- writing


def test_the_writer_inserts_with_clickhouse_connect_and_tokens_deduplicate(served: Served) -> None:
    writer = served.client("writer")  # compress=True: lz4-framed, chunked insert bodies
    writer.command("CREATE TABLE IF NOT EXISTS areal.http_rows (a UInt64, s String, m Map(String, Float64)) "
                   "ENGINE = MergeTree ORDER BY a SETTINGS non_replicated_deduplication_window = 100")
    rows = [[i, f"s{i}", {"k": i / 2}] for i in range(1000)]
    summary = writer.insert("http_rows", rows, column_names=["a", "s", "m"], settings={"insert_deduplication_token": "t1"})
    assert summary.written_rows == 1000
    writer.insert("http_rows", rows, column_names=["a", "s", "m"], settings={"insert_deduplication_token": "t1"})
    assert writer.command("SELECT count(), sum(a) FROM areal.http_rows") == ["1000", "499500"]  # the retry was dropped
    plain = served.client("writer", compress=False)
    plain.raw_insert("http_rows", ["a", "s"], insert_block='{"a": 5000, "s": "json"}\n', fmt="JSONEachRow")
    plain.command("INSERT INTO areal.http_rows (a, s) VALUES (5001, 'values')")
    r = served.http({"query": "INSERT INTO areal.http_rows (a, s) FORMAT TabSeparated"}, b"5002\ttsv\n5003\ttsv\n",
                    role="writer")
    assert r.status == 200 and json.loads(r.getheader("X-ClickHouse-Summary"))["written_rows"] == "2"
    r = served.http(None, b"INSERT INTO areal.http_rows (a, s) FORMAT CSV\n5004,csv\n", role="writer")
    assert r.status == 200, r.data
    gz = served.http({"query": "INSERT INTO areal.http_rows (a, s) FORMAT TSV"}, gzip.compress(b"5005\tgz\n"),
                     role="writer", headers={"Content-Encoding": "gzip"})
    assert gz.status == 200, gz.data
    assert plain.query("SELECT s FROM areal.http_rows WHERE a >= 5000 ORDER BY a").result_rows == [
        ("json",), ("values",), ("tsv",), ("tsv",), ("csv",), ("gz",)]
    bad = served.http({"query": "INSERT INTO areal.http_rows (a, s) FORMAT TSV"}, b"not-a-number\tx\n", role="writer")
    assert bad.status in (400, 500) and bad.getheader("X-ClickHouse-Exception-Code") not in (None, "0")
    writer.command("DROP TABLE areal.http_rows")


@pytest.mark.parametrize("method,encode", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                           ("lz4", lz4.frame.compress), ("zstd", lambda b: _zstd().compress(b))])
def test_compressed_request_bodies(served: Served, method: str, encode: Any) -> None:
    r = served.http(None, encode(b"SELECT count() FROM areal.steps FINAL"), headers={"Content-Encoding": method})
    assert r.status == 200 and r.data == f"{STEPS}\n".encode()
    bad = served.http(None, b"not compressed", headers={"Content-Encoding": method})
    assert bad.status == 500 and bad.getheader("X-ClickHouse-Exception-Code") == "271"  # CANNOT_DECOMPRESS


def test_a_chunked_request_body(served: Served) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    user = served.reader
    auth = base64.b64encode(f"{user.name}:{user.password}".encode()).decode()
    conn.request("POST", "/", body=iter([b"SELECT 40 ", b"+ 2"]), encode_chunked=True,
                 headers={"Authorization": f"Basic {auth}", "Transfer-Encoding": "chunked"})
    response = conn.getresponse()
    assert response.status == 200 and response.read() == b"42\n"
    conn.close()


# -------------------------------------------------------------- errors


def test_errors_carry_clickhouse_codes_text_and_status(served: Served) -> None:
    cases = {
        "SELEC 1": (62, 400, b"Syntax error"),
        "SELECT nope FROM areal.steps": (47, 404, b"nope"),
        "SELECT * FROM areal.no_table": (60, 404, b"no_table"),
        "SELECT no_function(1)": (46, 404, b"no_function"),
        "SELECT 1 FORMAT NoSuchFormat": (73, 404, b"NoSuchFormat"),
        "SELECT throwIf(1, 'boom')": (395, 500, b"boom"),
    }
    for sql, (code, status, text) in cases.items():
        r = served.http({"query": sql})
        assert (r.status, r.getheader("X-ClickHouse-Exception-Code")) == (status, str(code)), (sql, r.data)
        assert r.data.startswith(f"Code: {code}. DB::Exception: ".encode()) and text in r.data, r.data
        assert b"(version " in r.data
    with pytest.raises(DatabaseError) as err:
        served.client().query("SELECT nope FROM areal.steps")
    assert err.value.code == 47
    assert served.http({"query": "SELECT 1", "compress": "1"}).getheader("X-ClickHouse-Exception-Code") == "48"


def test_authentication(served: Served) -> None:
    sql = {"query": "SELECT currentUser() != ''"}
    for headers in ({"Authorization": "Basic " + base64.b64encode(b"reader:wrong").decode()},
                    {"Authorization": "Basic " + base64.b64encode(b"nobody:x").decode()},
                    {"X-ClickHouse-User": "writer", "X-ClickHouse-Key": "wrong"},
                    {"Authorization": "Bearer abc"},
                    {}):
        r = served.http(sql, role=None, headers=headers)
        assert (r.status, r.getheader("X-ClickHouse-Exception-Code")) == (403, "516"), headers
        assert b"Authentication failed" in r.data or b"Invalid authentication" in r.data
    with pytest.raises(DatabaseError) as err:
        clickhouse_connect.get_client(host="127.0.0.1", port=served.port, username="reader", password="wrong")
    assert err.value.code == 516
    ok = served.http(sql, role=None, headers={"X-ClickHouse-User": "reader", "X-ClickHouse-Key": served.reader.password})
    assert ok.status == 200 and ok.data == b"1\n"
    by_params = served.http({**sql, "user": "reader", "password": served.reader.password}, role=None)
    assert by_params.status == 200
    mixed = served.http({**sql, "user": "reader", "password": served.reader.password}, role="reader")
    assert mixed.getheader("X-ClickHouse-Exception-Code") == "516"


# ---------------------------------------------------------- compression


@pytest.mark.parametrize("method,decode", [("gzip", gzip.decompress), ("deflate", zlib.decompress),
                                           ("lz4", lz4.frame.decompress), ("zstd", lambda b: _zstd().decompress(b))])
def test_response_compression_when_asked_for(served: Served, method: str, decode: Any) -> None:
    sql = "SELECT step, reward FROM areal.v_steps ORDER BY run_id, step, rank FORMAT TSV"
    plain = served.http({"query": sql}).data
    r = served.http({"query": sql, "enable_http_compression": "1"}, headers={"Accept-Encoding": method})
    assert r.getheader("Content-Encoding") == method and decode(r.data) == plain and len(r.data) < len(plain)
    not_enabled = served.http({"query": sql}, headers={"Accept-Encoding": method})  # like ClickHouse: needs the setting
    assert not_enabled.getheader("Content-Encoding") is None and not_enabled.data == plain


def test_clickhouse_connect_compressed_and_not_agree(served: Served) -> None:
    sql = "SELECT run_id, step, rank, reward, metrics FROM areal.v_steps ORDER BY run_id, step, rank"
    compressed, plain = served.client("writer"), served.client("writer", compress=False)
    assert compressed.query(sql).result_rows == plain.query(sql).result_rows


# ---------------------------------------------------- concurrency and size


def test_concurrent_clients_each_get_their_own_answers(served: Served) -> None:
    """Grafana sends a dashboard's panels at once: 12 clients x 8 queries, each answer checked, and
    settings of one request never seen by another (the writers pass one per query; the readers
    cannot: clickhouse-connect refuses settings the server reports read-only)."""
    errors: list[str] = []

    def work(i: int) -> None:
        client = served.client("writer" if i % 2 else "reader")
        try:
            for j in range(8):
                limit = 1 + (i * 8 + j) % 50
                settings = {"max_block_size": 1000 + i * 10 + j} if i % 2 else None
                r = client.query(f"SELECT step, {i} AS me, getSetting('max_block_size') AS b FROM areal.v_steps "
                                 f"WHERE run_id = 'demo-g4' ORDER BY step, rank LIMIT {limit}", settings=settings)
                if len(r.result_rows) != limit or {row[1] for row in r.result_rows} != {i}:
                    errors.append(f"client {i} query {j}: {len(r.result_rows)} rows, me={ {x[1] for x in r.result_rows} }")
                block = {row[2] for row in r.result_rows}
                if settings and block != {settings["max_block_size"]}:
                    errors.append(f"client {i} query {j}: max_block_size {block}, sent {settings}")
                setting = served.http({"query": "SELECT getSetting('max_execution_time')", "max_execution_time": str(10 + i)})
                if setting.data != f"{10 + i}\n".encode():
                    errors.append(f"client {i}: saw max_execution_time {setting.data!r}")
        except Exception as exc:  # noqa: BLE001 - collected and reported below
            errors.append(f"client {i}: {exc!r}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:5]


def test_a_big_result(served: Served) -> None:
    sql = "SELECT number AS n, toString(number) AS s, number / 3 AS f FROM numbers(1000000)"
    r = served.client().query(sql)
    assert len(r.result_rows) == 1_000_000 and r.result_rows[-1][0] == 999_999 and r.result_rows[123][1] == "123"
    raw = served.http({"query": sql, "default_format": "Native", "client_protocol_version": "54460"})
    assert raw.status == 200 and len(raw.data) > 20_000_000


# ------------------------------------------------ what points Grafana at it


def test_status_dsn_and_grafana_provisioning_point_at_the_endpoint(served: Served, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The holder publishes owner.json; `http_dsn` (status --json) and `grafana provision --files` read it."""
    import yaml

    from areal_metrics.cli import main
    from areal_metrics.grafana.provision import ClickHouseServer
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.sinks.query import http_dsn

    served.server.publish()
    try:
        url = f"chdb://{served.server.path}"
        dsn = http_dsn(Settings(clickhouse_url=url))
        assert dsn == served.server.dsn() and dsn.startswith("http://reader:")
        assert clickhouse_connect.get_client(dsn=dsn).command("SELECT count() FROM steps FINAL") == STEPS
        server = ClickHouseServer.parse(dsn)
        assert (server.host, server.port, server.protocol, server.username, server.database) == (
            "127.0.0.1", served.port, "http", "reader", "areal")

        monkeypatch.setenv("AREAL_CLICKHOUSE_URL", url)
        monkeypatch.delenv("AREAL_GRAFANA_CLICKHOUSE_URL", raising=False)
        out = tmp_path / "provisioning"
        assert main(["grafana", "provision", "--files", str(out)]) == 0
        source = out / "datasources" / "clickhouse.yaml"
        assert source.stat().st_mode & 0o077 == 0  # it holds the reader's password
        ds = yaml.safe_load(source.read_text())["datasources"][0]
        assert ds["uid"] == "areal-clickhouse" and ds["type"] == "grafana-clickhouse-datasource"
        assert ds["jsonData"]["host"] == "127.0.0.1" and ds["jsonData"]["port"] == served.port
        assert ds["jsonData"]["protocol"] == "http" and ds["jsonData"]["username"] == "reader"
        assert ds["secureJsonData"]["password"] == served.reader.password
        provider = yaml.safe_load((out / "dashboards" / "areal.yaml").read_text())["providers"][0]
        dashboards = Path(provider["options"]["path"])
        assert dashboards.is_absolute() and sorted(p.stem for p in dashboards.glob("*.json")) == sorted(
            ["training", "evaluation", "runs", "efficiency", "alerts", "explorer"])
        assert "GF_PATHS_PROVISIONING=" in capsys.readouterr().err
    finally:
        (served.server.path / "owner.json").unlink()
    assert http_dsn(Settings(clickhouse_url=url)) is None
    assert main(["grafana", "provision", "--files", str(tmp_path / "again")]) == 1  # nothing serves the store now
    assert "start the stack" in capsys.readouterr().err


@pytest.mark.skipif(__import__("shutil").which("curl") is None, reason="curl is not installed")
def test_curl_on_the_dsn_answers_and_its_path_names_the_database(served: Served) -> None:
    import subprocess

    dsn = served.server.dsn()
    assert dsn.endswith("/areal")

    def curl(url: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["curl", "-sS", "--fail-with-body", url], capture_output=True, text=True, timeout=60)

    hello = curl(dsn)
    assert hello.returncode == 0 and hello.stdout == "Ok.\n", hello.stdout + hello.stderr
    count = curl(dsn + "?query=" + urllib.parse.quote("SELECT count() FROM v_steps"))  # no database prefix
    assert count.returncode == 0 and count.stdout.strip() == str(STEPS), count.stdout + count.stderr
    assert curl(dsn.rsplit("/", 1)[0] + "/elsewhere").returncode != 0  # other paths stay unknown
