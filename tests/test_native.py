"""`areal_metrics.sinks.http.native`: chdb's Native bytes laid out for a client's protocol revision.

The property test draws column types (nested Nullable, Array, Map, Tuple,
LowCardinality over every scalar the walker knows), lets the engine fill them
with random rows (`generateRandom`) in several blocks, and checks that the
walker delimits every column exactly: the names and types it reads back are
the ones asked for, it ends on the last byte, and the revision layout adds
exactly the block info and one byte per column. clickhouse-connect then
decodes the revision-54405 layout (block info, no per-column byte) to the same
rows as the original. The clickhouse-go test decodes the 54460 layout.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_metrics.sinks.http.native import (
    Reader,
    Truncated,
    UnsupportedType,
    block_info,
    for_revision,
    parse_type,
    skip_data,
    skip_prefix,
    split_top_level,
)

SCALARS = ["UInt8", "Int16", "UInt32", "Int64", "UInt64", "Int128", "UInt256", "Float32", "Float64", "Bool",
           "String", "FixedString(5)", "Date", "Date32", "DateTime", "DateTime('UTC')", "DateTime64(3, 'UTC')",
           "DateTime64(6)", "UUID", "IPv4", "IPv6", "Decimal(9, 2)", "Decimal(18, 4)", "Decimal(38, 10)",
           "Decimal(76, 20)", "Enum8('a' = 1, 'b, c' = 2)", "Enum16('x' = -3, 'y' = 1000)"]
LC_INNER = ["String", "FixedString(3)", "UInt32", "Date", "Nullable(String)", "Nullable(UInt64)"]


def types() -> st.SearchStrategy[str]:
    scalar = st.sampled_from(SCALARS)
    leaf = st.one_of(scalar, scalar.map(lambda t: f"Nullable({t})"),
                     st.sampled_from(LC_INNER).map(lambda t: f"LowCardinality({t})"))

    def nest(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        key = st.sampled_from(["String", "UInt64", "LowCardinality(String)", "Date"])
        return st.one_of(
            inner.map(lambda t: f"Array({t})"),
            st.tuples(key, inner).map(lambda kv: f"Map({kv[0]}, {kv[1]})"),
            st.lists(inner, min_size=1, max_size=3).map(lambda ts: f"Tuple({', '.join(ts)})"),
            st.lists(inner, min_size=1, max_size=3).map(
                lambda ts: "Tuple(" + ", ".join(f"f{i} {t}" for i, t in enumerate(ts)) + ")"),
        )

    return st.recursive(leaf, nest, max_leaves=6)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    import chdb

    path = tmp_path_factory.mktemp("native-engine")
    conn = chdb.connect(str(path))
    conn.path = path
    conn.query("SET max_block_size = 7")  # several blocks per result
    conn.query("SET allow_suspicious_low_cardinality_types = 1")
    yield conn
    conn.close()


def random_rows_sql(column_types: list[str], rows: int, seed: int) -> str:
    structure = ", ".join(f"c{i} {t}" for i, t in enumerate(column_types)).replace("\\", "\\\\").replace("'", "\\'")
    return f"SELECT * FROM generateRandom('{structure}', {seed}, 8, 3) LIMIT {rows}"


def random_rows(engine, column_types: list[str], rows: int, seed: int) -> bytes:
    return engine.query(random_rows_sql(column_types, rows, seed), "Native").bytes()


def walk(native: bytes) -> tuple[list[list[tuple[str, str]]], int]:
    """Every block's (name, type) columns, read with the walker; and the bytes consumed."""
    r = Reader(native)
    blocks = []
    while r.pos < len(native):
        columns, rows = r.varuint(), r.varuint()
        block = []
        for _ in range(columns):
            name, type_name = r.string().decode(), r.string().decode()
            if rows:
                t = parse_type(type_name)
                skip_prefix(r, t)
                skip_data(r, t, rows)
            block.append((name, type_name))
        blocks.append(block)
    return blocks, r.pos


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(column_types=st.lists(types(), min_size=1, max_size=4), rows=st.integers(0, 40), seed=st.integers(1, 10**6))
def test_the_walker_delimits_every_column_the_engine_writes(engine, column_types: list[str], rows: int, seed: int) -> None:
    native = random_rows(engine, column_types, rows, seed)
    blocks, consumed = walk(native)
    assert consumed == len(native)
    assert sum(1 for _ in blocks) == (0 if rows == 0 else -(-rows // 7))
    for block in blocks:  # the engine may spell a type differently: parse both
        assert [name for name, _ in block] == [f"c{i}" for i in range(len(column_types))]
        assert [parse_type(t) for _, t in block] == [parse_type(t) for t in column_types]
    for revision, extra_per_column in ((54405, 0), (54460, 1), (54480, 1)):
        out = list(for_revision(native, revision))
        assert len(out) == len(blocks)
        assert all(b.startswith(block_info(revision)) for b in out)
        added = len(blocks) * len(block_info(revision)) + len(blocks) * len(column_types) * extra_per_column
        assert sum(map(len, out)) == len(native) + added


@pytest.fixture(scope="module")
def clients(engine) -> Iterator[tuple[object, object]]:
    """clickhouse-connect over the HTTP endpoint (Native at its revision 54405) and in-process (revision 0)."""
    import clickhouse_connect

    from areal_metrics.sinks.http.server import ClickHouseHTTPServer

    server = ClickHouseHTTPServer(engine.path, "default")
    writer = server.users["writer"]
    over_http = clickhouse_connect.get_client(host="127.0.0.1", port=server.port, username=writer.name,
                                              password=writer.password, compress=False)
    in_process = clickhouse_connect.get_client(dsn=f"chdb://{engine.path}")
    assert over_http.protocol_version == 54405
    yield over_http, in_process
    in_process.close()
    server.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(column_types=st.lists(types(), min_size=1, max_size=3), rows=st.integers(1, 30), seed=st.integers(1, 10**6))
def test_clickhouse_connect_reads_the_block_info_layout_as_the_original(clients, column_types: list[str], rows: int,
                                                                         seed: int) -> None:
    over_http, in_process = clients
    sql = random_rows_sql(column_types, rows, seed)
    # one thread: generateRandom reads in parallel streams, whose blocks may come in either order
    options = {"max_block_size": 7, "allow_suspicious_low_cardinality_types": 1, "max_threads": 1}
    got, expected = (c.query(sql, settings=options).result_rows for c in (over_http, in_process))
    assert repr(got) == repr(expected)  # repr: NaN equals NaN


def test_block_info_by_revision() -> None:
    assert block_info(0) == b""
    assert block_info(54405) == block_info(54460) == b"\x01\x00\x02\xff\xff\xff\xff\x00"
    assert block_info(54480) == b"\x01\x00\x02\xff\xff\xff\xff\x03\x00\x00"  # out_of_order_buckets = []
    assert list(for_revision(b"", 54460)) == []
    assert list(for_revision(b"\x01\x00\x01x\x06UInt64", 0)) == [b"\x01\x00\x01x\x06UInt64"]  # revision 0: as is


def test_type_names() -> None:
    assert split_top_level("a String, b Map(String, Array(Tuple(x UInt8, `y z` String))), Enum8('a,b' = 1)") == [
        "a String", "b Map(String, Array(Tuple(x UInt8, `y z` String)))", "Enum8('a,b' = 1)"]
    assert parse_type("Tuple(x UInt8, `y z` Nullable(String))") == parse_type("Tuple(UInt8, Nullable(String))")
    assert parse_type("Point") == parse_type("Tuple(Float64, Float64)")
    assert parse_type("SimpleAggregateFunction(sum, UInt64)") == parse_type("UInt64")
    assert parse_type("Decimal(9, 2)").size == 4 and parse_type("Decimal(38, 2)").size == 16
    assert parse_type("IntervalSecond").size == 8 and parse_type("Nothing").size == 1
    for unsupported in ("Dynamic", "JSON", "Variant(String, UInt64)", "AggregateFunction(sum, UInt64)",
                        "Array(Object('json'))", "Wat"):
        with pytest.raises(UnsupportedType):
            parse_type(unsupported)


def test_truncated_data_is_an_error_not_garbage(engine) -> None:
    native = engine.query("SELECT number, toString(number) AS s, [number] AS a FROM numbers(20)", "Native").bytes()
    for cut in (3, len(native) // 2, len(native) - 1):
        with pytest.raises(Truncated):
            list(for_revision(native[:cut], 54460))


def test_self_describing_types_are_refused_not_guessed(engine) -> None:
    native = engine.query("SELECT 1::Dynamic AS d", "Native").bytes()
    with pytest.raises(UnsupportedType):
        list(for_revision(native, 54460))


def test_a_large_low_cardinality_column(engine, clients) -> None:
    """More distinct values than one LowCardinality dictionary granule holds by default (8192)."""
    sql = ("SELECT toLowCardinality(toString(number % 20000)) AS s, toLowCardinality(toNullable(toString(number))) AS n "
           "FROM numbers(50000)")
    native = engine.query(sql + " SETTINGS max_block_size = 50000", "Native").bytes()
    blocks, consumed = walk(native)
    assert consumed == len(native) and blocks
    over_http, in_process = clients
    one_thread = {"max_threads": 1}
    assert over_http.query(sql, settings=one_thread).result_rows == in_process.query(sql, settings=one_thread).result_rows
