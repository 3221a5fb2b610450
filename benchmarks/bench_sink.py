"""Sink benchmark: rows/s of the Kafka -> ClickHouse sink beside a direct bulk insert of
the same rows into the same embedded engine, and the latency from `publish()` to
the row being visible to `sql` (through the sink's query endpoint), all in one run.

    python -m benchmarks.bench_sink [--events N] [--samples K] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

from benchmarks.common import broker, machine, print_table, step_events, summary
from areal_metrics.producers.contract.events import StepEvent, parse_event
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.sinks.batching import BatchPolicy
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.query import Target, connect, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.sink import Sink
from areal_metrics.sinks.writer import insert_rows


def produce(bootstrap: str, topics: Topics, events: list[StepEvent]) -> list[bytes]:
    from kafka import KafkaProducer

    payloads = [e.to_json() for e in events]
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20, batch_size=256 * 1024)
    for e, raw in zip(events, payloads):
        producer.send(topics.steps, key=e.run_id.encode(), value=raw)
    producer.flush(300)
    producer.close()
    return payloads


LATENCY_POLICIES = (("500ms", 500, 0), ("50ms", 50, 0), ("500ms+idle50ms", 500, 50))  # (key suffix, max_wait, idle)


def bench_direct(url: str, payloads: list[bytes], chunk: int) -> dict[str, float]:
    """Parse + build + insert the same messages straight into the engine, no Kafka."""
    client = open_client(Target.parse(url), readonly=False, use_database=False)
    try:
        apply_schema(client)
        t0 = time.perf_counter()
        rows = [Located(parse_event(raw, StepEvent), "bench.steps", 0, i) for i, raw in enumerate(payloads)]
        parsed = time.perf_counter()
        for i in range(0, len(rows), chunk):
            insert_rows(client, "areal", rows[i:i + chunk], f"direct:{i}")
        done = time.perf_counter()
        assert int(client.command("SELECT count() FROM areal.steps")) == len(payloads)
        client.command("TRUNCATE TABLE areal.steps")
    finally:
        client.close()
    return {"direct_rows_per_s": len(payloads) / (done - t0), "insert_only_rows_per_s": len(payloads) / (done - parsed)}


def bench_sink(settings: Settings, n: int, policy: BatchPolicy) -> tuple[Sink, threading.Thread, dict[str, float]]:
    """Start a sink on a backlog of n messages; time from its Kafka connection to the last row stored."""
    sink = Sink(settings, policy=policy)
    thread = threading.Thread(target=sink.run, daemon=True)
    thread.start()
    while sink.consumer is None:
        time.sleep(0.01)
    t0 = time.perf_counter()
    while sink.stats["rows"] < n:
        time.sleep(0.01)
    elapsed = time.perf_counter() - t0
    return sink, thread, {"sink_rows_per_s": n / elapsed}


def bench_latency(settings: Settings, samples: int) -> dict[str, float]:
    """publish() one event, then poll `sql`'s path (areal_metrics.sinks.query.connect) until the row is visible."""
    from areal_metrics.producers.delivery.publisher import Publisher

    latencies = []
    with tempfile.TemporaryDirectory() as journal:
        publisher = Publisher.from_settings(settings, journal_dir=journal)
        for e in step_events(20, run_id="warmup"):
            publisher.publish(e)
        publisher.flush(60)
        with connect(settings) as store:
            for i in range(samples):
                event = StepEvent(run_id="latency", step=i, epoch=0, reward=0.5)
                t0 = time.perf_counter()
                publisher.publish(event)
                while not store.query(f"SELECT 1 FROM steps WHERE event_id = '{event.event_id}'").rows:
                    time.sleep(0.002)
                latencies.append((time.perf_counter() - t0) * 1000)
        publisher.close()
    s = summary(latencies)
    return {"latency_ms_p50": s["p50"], "latency_ms_p99": s["p99"], "latency_ms_max": s["max"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--samples", type=int, default=100, help="latency samples per batching policy")
    parser.add_argument("--max-rows", type=int, default=5_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from areal_metrics.stack.kafka_broker import create_topics

    result: dict[str, float] = {}
    store_dir = Path(tempfile.mkdtemp(prefix="areal-bench-ch-"))
    try:
        with broker() as bootstrap:
            topics = Topics(f"bench{uuid.uuid4().hex[:6]}.")
            create_topics(bootstrap, topics.all(), partitions=3)
            payloads = produce(bootstrap, topics, step_events(args.events))
            url = f"chdb://{store_dir}"
            result.update(bench_direct(url, payloads, args.max_rows))
            settings = Settings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, clickhouse_url=url)
            # the wait alone (idle flush off), then the default (max_wait 500 ms, flush once quiet for 50 ms)
            for i, (name, wait_ms, idle_ms) in enumerate(LATENCY_POLICIES):
                policy = BatchPolicy(max_rows=args.max_rows, max_wait_s=wait_ms / 1000, idle_s=idle_ms / 1000)
                sink, thread, figures = bench_sink(settings, args.events if i == 0 else 0, policy)
                if i == 0:  # the backlog is consumed once, by the first sink
                    result.update(figures)
                lat = bench_latency(settings, args.samples)
                result.update({f"{k}@{name}": v for k, v in lat.items()})
                sink.stop()
                thread.join(60)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)

    print(f"machine: {machine()}")
    ratio = result["sink_rows_per_s"] / result["direct_rows_per_s"]
    print_table(
        f"sink: {args.events} step events (all fields), chunks of {args.max_rows} rows, embedded engine (chdb)",
        [
            ("direct bulk insert of prebuilt rows", f"{result['insert_only_rows_per_s']:,.0f} rows/s",
             f"{result['insert_only_rows_per_s'] / result['direct_rows_per_s']:.2f}"),
            ("direct: validate JSON + build + insert", f"{result['direct_rows_per_s']:,.0f} rows/s", "1.00 (baseline)"),
            ("sink: Kafka -> validate -> insert -> commit", f"{result['sink_rows_per_s']:,.0f} rows/s", f"{ratio:.2f} of direct"),
        ]
        + [
            (f"publish() -> visible to sql, max_wait {w} ms, idle flush {f'{i} ms' if i else 'off'} p50 / p99",
             f"{result[f'latency_ms_p50@{name}']:.0f} / {result[f'latency_ms_p99@{name}']:.0f} ms", "")
            for name, w, i in LATENCY_POLICIES
        ],
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
