"""Publisher benchmark: the caller's cost of publish() and the delivered rate,
beside a raw kafka-python send() loop and TensorBoard's add_scalar, all in the
same run against the same broker.

    python -m benchmarks.bench_publisher [--events N] [--json PATH]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.common import (
    measure_and_report,
    print_table,
    step_events,
    summary,
)
from areal_metrics.producers.delivery.publisher import Publisher
from areal_metrics.producers.contract.topics import Topics

SCALARS = ("reward", "entropy", "kl", "clip_ratio", "loss", "lr", "grad_norm", "response_length", "throughput")


def bench_publish(bootstrap: str, n: int) -> dict[str, float]:
    topics = Topics(f"bench{uuid.uuid4().hex[:6]}.")
    events = step_events(n)
    with tempfile.TemporaryDirectory() as journal:
        publisher = Publisher(bootstrap, topics, Path(journal))
        for e in step_events(200, run_id="warmup"):  # connect and fetch metadata first
            publisher.publish(e)
        publisher.flush(60)
        costs = []
        clock = time.perf_counter_ns
        started = time.perf_counter()
        for e in events:
            t0 = clock()
            publisher.publish(e)
            costs.append((clock() - t0) / 1000)
        enqueued = time.perf_counter() - started
        ok = publisher.flush(300)
        delivered = time.perf_counter() - started
        publisher.close()
        stats = publisher.stats()
    assert ok and stats.spilled == 0, stats
    s = summary(costs)
    return {"publish_us_p50": s["p50"], "publish_us_p99": s["p99"], "publish_us_max": s["max"],
            "enqueue_events_per_s": n / enqueued, "publisher_events_per_s": n / delivered}


def bench_raw_send(bootstrap: str, n: int) -> dict[str, float]:
    """The same events through a bare KafkaProducer.send() on the caller's thread (serialising there)."""
    from kafka import KafkaProducer

    topic = f"bench{uuid.uuid4().hex[:6]}.steps"
    events = step_events(n)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5)
    for e in step_events(200, run_id="warmup"):
        producer.send(topic, key=e.run_id.encode(), value=e.to_json())
    producer.flush(60)
    costs = []
    clock = time.perf_counter_ns
    started = time.perf_counter()
    for e in events:
        t0 = clock()
        producer.send(topic, key=e.run_id.encode(), value=e.to_json())
        costs.append((clock() - t0) / 1000)
    producer.flush(300)
    delivered = time.perf_counter() - started
    producer.close()
    s = summary(costs)
    return {"raw_send_us_p50": s["p50"], "raw_send_us_p99": s["p99"], "raw_events_per_s": n / delivered}


def bench_tensorboard(n: int) -> dict[str, float]:
    """The same scalars through TensorBoard's SummaryWriter.add_scalar (one call per scalar)."""
    from torch.utils.tensorboard import SummaryWriter

    events = step_events(n)
    with tempfile.TemporaryDirectory() as logdir:
        writer = SummaryWriter(logdir)
        costs = []
        clock = time.perf_counter_ns
        for e in events:
            t0 = clock()
            for name in SCALARS:
                writer.add_scalar(name, getattr(e, name), e.step)
            costs.append((clock() - t0) / 1000)
        writer.close()
    s = summary(costs)
    return {"tensorboard_us_p50": s["p50"], "tensorboard_us_p99": s["p99"]}


def run(bootstrap: str, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    out.update(bench_raw_send(bootstrap, n))
    out.update(bench_publish(bootstrap, n))
    out.update(bench_tensorboard(min(n, 20_000)))
    return out


def report(r: dict[str, float]) -> None:
    print_table("publisher: caller's cost per event (one step event, 9 scalars + envelope)", [
        ("publish() p50 / p99", f"{r['publish_us_p50']:.2f} / {r['publish_us_p99']:.2f} us", "1.00 (ours)"),
        ("raw KafkaProducer.send() p50 / p99", f"{r['raw_send_us_p50']:.2f} / {r['raw_send_us_p99']:.2f} us",
         f"{r['raw_send_us_p50'] / r['publish_us_p50']:.1f}x slower than publish() (p50)"),
        ("TensorBoard add_scalar x9 p50 / p99", f"{r['tensorboard_us_p50']:.2f} / {r['tensorboard_us_p99']:.2f} us",
         f"{r['tensorboard_us_p50'] / r['publish_us_p50']:.1f}x slower than publish() (p50)"),
        ("delivered by Publisher (acks=all)", f"{r['publisher_events_per_s']:,.0f} ev/s",
         f"{r['publisher_events_per_s'] / r['raw_events_per_s']:.2f} of raw"),
        ("delivered by raw send loop (acks=all)", f"{r['raw_events_per_s']:,.0f} ev/s", "1.00 (baseline)"),
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    return measure_and_report(lambda bootstrap: run(bootstrap, args.events), report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
