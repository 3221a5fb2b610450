"""The server path: the same schema, inserts and queries against a real ClickHouse server
(testcontainers), compared with the embedded engine. Skipped where Docker is not available."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import EvalEvent, StepEvent
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.sinks.migrations import apply_schema, schema_statements
from areal_metrics.sinks.query import DirectStore, QueryError, Target, connect, open_client
from areal_metrics.sinks.replay import fingerprints
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import TABLES
from areal_metrics.sinks.writer import insert_rows

pytestmark = pytest.mark.timeout(300)


def docker_available() -> str | None:
    """None when a Docker daemon answers, else why not."""
    try:
        import docker

        docker.from_env().ping()
    except Exception as exc:  # noqa: BLE001 - any failure means: no Docker here
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return None


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    why = docker_available()
    if why is not None:
        pytest.skip(f"Docker is not available: {why}")
    from testcontainers.community.clickhouse import ClickHouseContainer

    with ClickHouseContainer("clickhouse/clickhouse-server:24.8", username="areal", password="secret") as ch:
        host, port = ch.get_container_host_ip(), ch.get_exposed_port(8123)
        url = f"http://areal:secret@{host}:{port}/areal"
        deadline = time.monotonic() + 60
        while True:
            try:
                open_client(Target.parse(url), readonly=False, use_database=False).command("SELECT 1")
                break
            except Exception:  # noqa: BLE001 - still starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        yield url


def sample_rows() -> list[Located]:
    out: list[Located] = []
    for i in range(20):
        out.append(Located(StepEvent(run_id="r1", step=i, epoch=0, reward=0.5, metrics={"m": 1.0}, ts=1.7e9 + i, event_id=f"s{i}"), "areal.steps", 0, i))
    out.append(Located(EvalEvent(run_id="r1", eval_id="e", step=3, dataset="d", accuracy=0.5, verdicts=[1, 0], n_samples=2, ts=1.7e9, event_id="e1"), "areal.evals", 0, 0))
    return out


def load(client) -> None:
    rows = sample_rows()
    steps, evals = rows[:20], rows[20:]
    for _ in range(2):  # the retry after a crash: same tokens, dropped
        insert_rows(client, "areal", steps, "areal.steps:0:0-19")
        insert_rows(client, "areal", evals, "areal.evals:0:0-0")
    insert_rows(client, "areal", steps[:5], "areal.steps:0:0-4/resent")  # re-sent events: FINAL collapses them


def column_types(client) -> dict[tuple[str, str], str]:
    r = client.query("SELECT table, name, type FROM system.columns WHERE database = 'areal' ORDER BY table, position")
    return {(t, n): typ for t, n, typ in r.result_rows}


def test_server_and_embedded_paths_agree(server_url: str, tmp_path: Path) -> None:
    server = open_client(Target.parse(server_url), readonly=False, use_database=False)
    embedded = open_client(Target.parse(f"chdb://{tmp_path / 'ch'}"), readonly=False, use_database=False)
    try:
        for client in (server, embedded):
            assert apply_schema(client) == apply_schema(client) == 1  # the same statements, twice
            load(client)
        assert column_types(server) == column_types(embedded)
        assert fingerprints(server) == fingerprints(embedded)
        assert int(server.command("SELECT count() FROM areal.steps")) == 25  # one block dropped by its token
        assert int(server.command("SELECT count() FROM areal.v_steps")) == 20
    finally:
        server.close()
        embedded.close()


def test_connect_over_http_is_read_only_by_default(server_url: str) -> None:
    settings = Settings(clickhouse_url=server_url)
    with connect(settings) as store:
        assert isinstance(store, DirectStore)
        assert store.query("SELECT count() FROM v_steps").rows == [(20,)]
        with pytest.raises(QueryError, match="readonly"):
            store.query("TRUNCATE TABLE steps")
    with connect(settings, write=True) as store:
        store.command("SELECT 1")


@pytest.mark.broker
def test_sink_into_a_server(server_url: str, kafka_bootstrap: str, topics: Topics) -> None:
    from kafka import KafkaProducer

    from areal_metrics.sinks.batching import BatchPolicy
    from areal_metrics.sinks.sink import Sink

    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix, clickhouse_url=server_url)
    client = open_client(Target.parse(server_url), readonly=False, use_database=False)
    apply_schema(client)
    for t in TABLES:
        client.command(f"TRUNCATE TABLE areal.{t.name}")
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    events = [StepEvent(run_id="r9", step=i, epoch=0) for i in range(200)]
    for e in events + events[:30]:
        producer.send(topics.steps, key=b"r9", value=e.to_json())
    producer.flush()
    producer.close()
    sink = Sink(settings, policy=BatchPolicy(max_rows=64, max_wait_s=0.1))
    thread = threading.Thread(target=sink.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while int(client.command("SELECT count() FROM areal.v_steps")) < 200 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert int(client.command("SELECT count() FROM areal.v_steps")) == 200
    finally:
        sink.stop()
        thread.join(30)
        client.close()


def test_the_same_statements_serve_both_paths() -> None:
    # one generator, no branch on the backend: what the embedded tests exercise is what a server gets
    assert schema_statements() == schema_statements()
    assert not any("chdb" in s.lower() for s in schema_statements())
