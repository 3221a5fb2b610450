"""Stream worker benchmark: throughput beside a raw consumer, and step -> reward_smoothed latency.

    .venv/bin/python -m benchmarks.bench_streams [--events 20000] [--runs 8] [--rate 200] [--seconds 10]
                                                 [--profile FILE] [--profile-core FILE]

Uses $AREAL_KAFKA_BOOTSTRAP when set, else starts a local broker (areal_metrics.stack.kafka_broker).
Each run of the benchmark uses a fresh topic prefix (so a fresh consumer group and changelog).

1. Throughput: `--events` step events are written to the steps topic first. Then
   - core only: the worker's per-message code (StreamCore) in-process, no Faust, no Kafka;
   - baseline: a raw aiokafka consumer (the client Faust uses) reads the same topic from the
     start: events/s from its first to its last record;
   - worker: `python -m areal_metrics.streams` reads it: events/s between the first and the last
     `reward_smoothed` it writes (Kafka CreateTime of its records: startup is not counted),
     and the worker process's CPU time (user + system, all threads, from /proc) over that
     span per event.
   - send cost: CPU per message to deliver 20,000 messages 500 at a time with aiokafka's
     `send()` one by one, then as record batches (areal_metrics.streams.shell.record_batches), in this process.
   With `--profile FILE` the worker runs under cProfile timed by CPU time (process_time:
   on a shared machine a wall-clock profiler mostly measures the time the process waits
   for a core), and FILE gets the functions that cost the most (`benchmarks.profiling`).
2. Latency: with the worker caught up, steps are produced at `--rate` per second for
   `--seconds`; latency = arrival of the step's `reward_smoothed` at a consumer minus the
   moment the step was handed to the producer. p50 / p99 / max.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from areal_metrics.producers.contract.settings import is_set, read_setting
from areal_metrics.producers.contract.events import StepEvent
from benchmarks.common import percentile
from areal_metrics.producers.contract.topics import Topics

ROOT = Path(__file__).resolve().parents[1]


def fill(bootstrap: str, topic: str, n: int, runs: int) -> None:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=20, batch_size=256 * 1024)
    for i in range(n):
        run = f"bench-{i % runs}"
        step = i // runs
        ev = StepEvent(run_id=run, node="n0", step=step, epoch=0, reward=0.5 + 0.001 * (step % 100),
                       throughput=1000.0, ts=time.time())
        producer.send(topic, key=run.encode(), value=ev.to_json())
    producer.flush(120)
    producer.close()


async def raw_consume(bootstrap: str, topic: str, n: int) -> float:
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        seen, first = 0, None
        while seen < n:
            batch = await consumer.getmany(timeout_ms=1000, max_records=10000)
            for records in batch.values():
                if first is None and records:
                    first = time.perf_counter()
                for r in records:
                    json.loads(r.value)  # the worker decodes too; a fair baseline reads the JSON
                seen += len(records)
        assert first is not None
        return (n - 1) / (time.perf_counter() - first)
    finally:
        await consumer.stop()


def core_only(n: int, runs: int, batch: int = 500, profile: Path | None = None) -> float:
    """events/s of the worker's own work (parse, core, encode, state records) in batches of
    `batch` messages, without Faust or Kafka. With `profile`, under cProfile timed by CPU
    time (then the rate is the profiled one's); the report goes to that file."""
    from areal_metrics.streams.shell.batch import Input, StreamCore
    from areal_metrics.streams.core.config import StreamsConfig

    topics = Topics("core.")
    msgs = []
    for i in range(n):
        run = f"bench-{i % runs}"
        ev = StepEvent(run_id=run, node="n0", step=i // runs, epoch=0, reward=0.5, throughput=1000.0, ts=time.time())
        msgs.append((run.encode(), ev.to_json()))

    async def send(topic: str, key: bytes, value: bytes):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(None)
        return fut

    async def go() -> float:
        core = StreamCore(topics=topics, config=StreamsConfig(), table={}, send=send)
        inputs = [Input(topics.steps, 0, offset, key, value, 1.0) for offset, (key, value) in enumerate(msgs)]
        start = time.process_time()
        for i in range(0, n, batch):
            await core.on_batch(inputs[i:i + batch])
        return n / (time.process_time() - start)

    if profile is None:
        return asyncio.run(go())
    import cProfile

    from benchmarks.profiling import report

    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    try:
        return asyncio.run(go())
    finally:
        profiler.disable()
        report(profiler, profile)


async def send_cost(bootstrap: str, topic: str, n: int, batch: int = 500) -> tuple[float, float]:
    """CPU microseconds per message (this process, all threads) to deliver `n` reward_smoothed-sized
    messages with acks=all: (aiokafka's send() one by one, areal_metrics.streams.shell.record_batches), `batch` at a
    time and each batch awaited, as the worker sends a batch's outputs."""
    from aiokafka import AIOKafkaProducer

    from areal_metrics.streams.shell.record_batches import send_in_batches

    value = b'{"type":"reward_smoothed","run_id":"bench-0","step":1,"reward":0.5,"window":10}' * 2
    messages = [(topic, None, f"bench-{i % 8}".encode(), value) for i in range(n)]
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_batch_size=256 * 1024)
    await producer.start()
    try:
        costs = []
        for batched in (False, True):
            start = time.process_time()
            for i in range(0, n, batch):
                chunk = messages[i:i + batch]
                if batched:
                    delivered = await send_in_batches(producer, chunk)
                else:
                    delivered = [await producer.send(t, v, key=k) for t, _, k, v in chunk]
                for fut in delivered:
                    await fut
            costs.append((time.process_time() - start) / n * 1e6)
        return costs[0], costs[1]
    finally:
        await producer.stop()


def start_worker(bootstrap: str, topics: Topics, home: Path, log: Path, profile: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ, AREAL_KAFKA_BOOTSTRAP=bootstrap, AREAL_TOPIC_PREFIX=topics.prefix,
               AREAL_HOME=str(home), AREAL_STREAMS_SESSION_TIMEOUT="6")
    env.pop("AREAL_STREAMS_CONFIG", None)
    command = [sys.executable, "-m", "areal_metrics.streams"]
    if profile is not None:
        command = [sys.executable, "-m", "benchmarks.profiling", str(profile), "streams"]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def worker_throughput(bootstrap: str, topics: Topics, n: int, timeout: float, pid: int) -> tuple[float, float, float]:
    """(events/s between first and last output, seconds from first output to last, worker CPU
    microseconds per event from the first output seen to the last)."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(topics.smoothed, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                             enable_auto_commit=False, group_id=None)
    stamps: list[int] = []
    cpu0 = None
    deadline = time.monotonic() + timeout
    while len(stamps) < n and time.monotonic() < deadline:
        for records in consumer.poll(timeout_ms=100, max_records=20000).values():
            if cpu0 is None:
                cpu0, first = cpu_seconds(pid), len(records)
            stamps.extend(r.timestamp for r in records)
    cpu1 = cpu_seconds(pid)
    consumer.close()
    if len(stamps) < n or cpu0 is None:
        raise RuntimeError(f"worker wrote {len(stamps)} of {n} reward_smoothed events in {timeout:.0f} s")
    span = (max(stamps) - min(stamps)) / 1000.0
    return (n - 1) / span, span, (cpu1 - cpu0) / max(1, n - first) * 1e6


def latency(bootstrap: str, topics: Topics, rate: float, seconds: float, runs: int) -> list[float]:
    from kafka import KafkaConsumer, KafkaProducer

    consumer = KafkaConsumer(topics.smoothed, bootstrap_servers=bootstrap, auto_offset_reset="latest",
                             enable_auto_commit=False, group_id=None, fetch_max_wait_ms=5)
    while not consumer.assignment():
        consumer.poll(timeout_ms=100)
    consumer.poll(timeout_ms=200)
    sent_at: dict[tuple[str, int], float] = {}
    arrived: dict[tuple[str, int], float] = {}
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            for records in consumer.poll(timeout_ms=50).values():
                now = time.perf_counter()
                for r in records:
                    v = json.loads(r.value)
                    arrived.setdefault((v["run_id"], v["step"]), now)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=0)
    n = int(rate * seconds)
    start = time.perf_counter()
    for i in range(n):
        due = start + i / rate
        pause = due - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        run = f"lat-{i % runs}"
        step = i // runs
        ev = StepEvent(run_id=run, node="n0", step=step, epoch=0, reward=0.5, ts=time.time())
        sent_at[(run, step)] = time.perf_counter()
        producer.send(topics.steps, key=run.encode(), value=ev.to_json())
    producer.flush(30)
    end = time.monotonic() + 15
    while len(arrived) < n and time.monotonic() < end:
        time.sleep(0.1)
    done.set()
    reader.join(5)
    producer.close()
    consumer.close()
    return [(arrived[k] - t) * 1000.0 for k, t in sent_at.items() if k in arrived]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--rate", type=float, default=200.0, help="steps/s in the latency phase")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the latency phase")
    parser.add_argument("--profile", type=Path, help="run the worker under cProfile (CPU time); its report goes here")
    parser.add_argument("--profile-core", type=Path,
                        help="also profile the core alone (cProfile, CPU time); its report goes here")
    args = parser.parse_args()

    broker = None
    bootstrap = read_setting("kafka_bootstrap") if is_set("kafka_bootstrap") else None
    work = Path(tempfile.mkdtemp(prefix="bench-streams-"))
    if not bootstrap:
        from areal_metrics.stack.kafka_broker import KafkaBroker
        from areal_metrics.stack.settings import StackSettings

        broker = KafkaBroker(work / "kafka", stack=StackSettings.from_env())
        broker.start(timeout=120)
        bootstrap = broker.bootstrap
    from areal_metrics.stack.kafka_broker import create_topics

    topics = Topics(f"bench{uuid.uuid4().hex[:8]}.")
    send_topic = topics.prefix + "send-cost"
    create_topics(bootstrap, [*topics.all(), send_topic], partitions=3)
    worker = None
    try:
        t = time.perf_counter()
        fill(bootstrap, topics.steps, args.events, args.runs)
        print(f"wrote {args.events} step events ({args.runs} runs) in {time.perf_counter() - t:.1f} s")
        raw = asyncio.run(raw_consume(bootstrap, topics.steps, args.events))
        worker = start_worker(bootstrap, topics, work / "home", work / "worker.log", args.profile)
        rate, span, cpu_us = worker_throughput(bootstrap, topics, args.events, timeout=600, pid=worker.pid)
        core = core_only(args.events, args.runs)
        if args.profile_core:
            core_only(args.events, args.runs, profile=args.profile_core)
            print(f"profile of the core alone: {args.profile_core}")
        one_by_one, batched = asyncio.run(send_cost(bootstrap, send_topic, 20000))
        print(f"throughput  raw aiokafka consumer: {raw:10,.0f} events/s")
        print(f"throughput  worker core, no Kafka: {core:10,.0f} events/s of CPU  "
              f"({1e6 / core:.1f} us/event: parse + core + encode + state records, batches of 500)")
        print(f"throughput  stream worker:         {rate:10,.0f} events/s  ({span:.1f} s for {args.events}); "
              f"CPU {cpu_us:.1f} us/event")
        print(f"send cost   aiokafka send() one by one: {one_by_one:.1f} us/message of CPU; "
              f"record batches (areal_metrics.streams.shell.record_batches): {batched:.1f} us/message (500 at a time, acks=all)")
        print(f"ratio worker/raw: {rate / raw:.3f}; load average {os.getloadavg()[0]:.1f}")
        lat = latency(bootstrap, topics, args.rate, args.seconds, args.runs)
        expected = int(args.rate * args.seconds)
        print(f"latency step -> reward_smoothed at {args.rate:g} steps/s, {len(lat)}/{expected} seen: "
              f"p50 {statistics.median(lat):.1f} ms  p99 {percentile(lat, 99):.1f} ms  max {max(lat):.1f} ms")
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        if broker is not None:
            broker.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
