"""Training step time with publishing off, on (Publisher to a real broker), and with TensorBoard.

    .venv/bin/python -m benchmarks.bench_train [--steps 300] [--repeats 3]

One rank in this process (the publishing cost is per process). The three
modes run interleaved, `--repeats` times each, on the same seeded trainer:

- off: the step's events are built and dropped (the baseline);
- kafka: `Publisher.publish(event)` to a real broker (AREAL_KAFKA_BOOTSTRAP,
  or one this benchmark starts), then flushed after the timed run;
- tensorboard: the same scalars (every numeric field of the step event) with
  `SummaryWriter.add_scalar`, the usual alternative.

The step time is the median interval between consecutive steps' publish
calls, so it includes the previous step's publishing cost. Evaluations are
off, so only training steps are timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from benchmarks.common import broker, machine, print_table
from producers.events import Event, StepEvent


def scalars(event: StepEvent) -> dict[str, float]:
    """Every number a step event carries: what TensorBoard would log."""
    out = {}
    for name in ("reward", "reward_std", "entropy", "advantage_mean", "advantage_std", "kl", "clip_ratio", "loss",
                 "lr", "grad_norm", "response_length", "tokens", "throughput", "latency_ms", "gpu_mem_bytes"):
        value = getattr(event, name)
        if value is not None:
            out[f"train/{name}"] = float(value)
    out.update({f"train/{k}": v for k, v in event.metrics.items()})
    return out


def timed_run(steps: int, sink: Callable[[Event], None]) -> list[float]:
    from areal_train.config import TrainConfig
    from areal_train.trainer import train

    stamps: list[float] = []

    def publish(event: Event) -> None:
        sink(event)
        if isinstance(event, StepEvent):
            stamps.append(time.perf_counter())

    cfg = TrainConfig(seed=0, eval_at_start=False, eval_every_steps=None, eval_at_end=False, publish=False)
    train(cfg, f"bench-{uuid.uuid4().hex[:6]}", steps, publish=publish)
    intervals = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]
    return intervals[10:]  # after warm-up


def two_runs(steps: int) -> int:
    """The demo's budget: two runs of 2 ranks each, side by side, publishing to a real broker."""
    import json
    import os

    from areal_metrics.stack.kafka_broker import create_topics
    from areal_train.config import TrainConfig
    from areal_train.launch import start
    from producers.topics import Topics

    print(f"machine: {machine()}")
    with broker() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        topics = Topics(f"bench{uuid.uuid4().hex[:6]}.")
        create_topics(bootstrap, topics.all(), partitions=3)
        env = dict(os.environ, AREAL_KAFKA_BOOTSTRAP=bootstrap, AREAL_TOPIC_PREFIX=topics.prefix,
                   AREAL_HOME=str(Path(tmp) / "home"))
        configs = {"run-a": TrainConfig(), "run-b": TrainConfig(lr=2e-3, seed=1)}
        started = time.perf_counter()
        runs = [start(name, 2, steps, cfg, env=env, log_dir=Path(tmp) / "logs", summary_dir=Path(tmp) / name)
                for name, cfg in configs.items()]
        codes = [r.wait(600) for r in runs]
        wall = time.perf_counter() - started
        print(f"\ntwo runs x 2 ranks x {steps} steps, side by side: {wall:.1f} s wall, exit {codes}")
        for name, cfg in configs.items():
            for path in sorted((Path(tmp) / name).glob("rank*.json")):
                s = json.loads(path.read_text())
                print(f"  {name} (lr {cfg.lr:g}) rank {s['rank']}: {s['seconds']:.1f} s training, "
                      f"reward {s['first_reward']:.3f} -> {s['last_reward']:.3f}")
    return 0 if not any(codes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_train")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval in seconds (default: Python's 5 ms)")
    parser.add_argument("--two-runs", action="store_true",
                        help="instead: time two 2-rank runs side by side (the demo's budget)")
    args = parser.parse_args(argv)
    if args.two_runs:
        return two_runs(args.steps)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    from torch.utils.tensorboard import SummaryWriter

    from producers.publisher import Publisher
    from producers.topics import Topics

    print(f"machine: {machine()}; GIL switch interval {sys.getswitchinterval() * 1000:g} ms")
    times: dict[str, list[float]] = {"off": [], "kafka": [], "tensorboard": []}
    with broker() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        publisher = Publisher(bootstrap, Topics(f"bench{uuid.uuid4().hex[:6]}."), Path(tmp) / "journal")
        writer = SummaryWriter(log_dir=str(Path(tmp) / "tb"))

        def to_tensorboard(event: Event) -> None:
            if isinstance(event, StepEvent):
                for tag, value in scalars(event).items():
                    writer.add_scalar(tag, value, event.step)

        sinks: dict[str, Callable[[Event], None]] = {"off": lambda e: None, "kafka": publisher.publish,
                                                     "tensorboard": to_tensorboard}
        timed_run(20, publisher.publish)  # warm up the producer connection and torch
        for _ in range(args.repeats):
            for mode, sink in sinks.items():
                times[mode] += timed_run(args.steps, sink)
        flushed = publisher.flush(60)
        stats = publisher.stats()
        publisher.close()
        writer.close()

    base = statistics.median(times["off"])
    rows = []
    for mode, label in (("off", "publishing off"), ("kafka", "Publisher -> Kafka"),
                        ("tensorboard", "TensorBoard SummaryWriter")):
        med = statistics.median(times[mode])
        ratio = "1.00 (baseline)" if mode == "off" else f"{med / base:.3f} ({(med / base - 1) * 100:+.1f}%)"
        rows.append((f"{label}: step p50 / mean", f"{med:.2f} / {statistics.fmean(times[mode]):.2f} ms", ratio))
    print_table(f"trainer step time, 1 rank, {args.steps} steps x {args.repeats} repeats per mode, interleaved", rows)
    print(f"\n  Kafka: {stats.sent + stats.resent} of {stats.queued} events acknowledged"
          f" ({'flushed' if flushed else 'NOT flushed'}), {stats.spilled} spilled to the journal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
