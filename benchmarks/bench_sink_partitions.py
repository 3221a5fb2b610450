"""The sink over many partitions: step events of 64 runs spread over P partitions of the steps topic, produced
at a steady rate while one sink (in this process, embedded store) stores them; its process's CPU per row.

    python -m benchmarks.bench_sink_partitions [--partitions 12] [--rate 2000] [--seconds 15]

The store's cost is mostly per INSERT (PERFORMANCE.md "The sink's cost per block"), and a flush inserts a block
per topic, so this measures what the number of partitions costs. Run it at two commits to compare them: the
figure includes the producer's CPU (the same in both), so quote the difference, and the seconds the sink took
to store what was produced in `--seconds` (above it: the sink fell behind).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import uuid

from benchmarks.common import broker

RUNS = 64
RANKS = 8


def run(bootstrap: str, partitions: int, rate: int, seconds: int) -> dict[str, float]:
    from kafka import KafkaProducer

    from areal_metrics.producers.contract.events import StepEvent
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.producers.contract.topics import Topics
    from areal_metrics.sinks.batching import BatchPolicy
    from areal_metrics.sinks.sink import Sink
    from areal_metrics.stack.kafka_broker import create_topics

    topics = Topics(f"sp{uuid.uuid4().hex[:6]}.")
    create_topics(bootstrap, topics.all(), partitions=partitions)
    with tempfile.TemporaryDirectory() as store:
        settings = Settings(kafka_bootstrap=bootstrap, topic_prefix=topics.prefix, clickhouse_url=f"chdb://{store}")
        sink = Sink(settings, policy=BatchPolicy())
        thread = threading.Thread(target=sink.run, daemon=True)
        thread.start()
        while sink.consumer is None or not sink.consumer.assignment():
            time.sleep(0.05)
        n = rate * seconds
        messages = []
        for i in range(n):  # a run to a partition, as the run_id key would put it
            e = StepEvent(run_id=f"run{i % RUNS}", step=i // (RUNS * RANKS), rank=(i // RUNS) % RANKS,
                          world_size=RANKS, epoch=0, reward=0.5)
            messages.append(((i % RUNS) % partitions, e.run_id.encode(), e.to_json()))
        producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
        time.sleep(2)  # past the sink's first polls
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i, (partition, key, value) in enumerate(messages):
            producer.send(topics.steps, key=key, value=value, partition=partition)
            if i % max(1, rate // 20) == 0:  # paced: `rate` a second
                time.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        producer.flush()
        while sink.stats["rows"] < n:
            time.sleep(0.01)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        stats = dict(sink.stats)
        sink.stop()
        thread.join(60)
        producer.close()
    return {"partitions": partitions, "rate": rate, "rows": n, "process_cpu_us_per_row": cpu / n * 1e6,
            "stored_in_s": wall, "produced_in_s": seconds, "chunks": stats["chunks"], "flushes": stats["commits"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--partitions", type=int, default=12)
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--seconds", type=int, default=15)
    args = parser.parse_args()
    with broker() as bootstrap:
        print(json.dumps(run(bootstrap, args.partitions, args.rate, args.seconds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
