"""The trainer's costs: CPU per step, publishing beside TensorBoard, evaluation per rank with sharding.

    .venv/bin/python -m benchmarks.bench_train [--steps 30]            # CPU cost of a step (mt1, mt2, mt4)
    .venv/bin/python -m benchmarks.bench_train --publishing [--steps 100 --repeats 3]
    .venv/bin/python -m benchmarks.bench_train --eval-sharding [--ranks 4]
    .venv/bin/python -m benchmarks.bench_train --two-runs [--steps 60]

One rank in this process, on the cached warm start (built first if missing):

- step cost: wall and CPU seconds (this process) per training step, the
  generated tokens per step and the tokens per CPU second, for 1, 2 and 4
  attempts per episode; evaluations off, publishing off;
- publishing: the step time with publishing off, with `Publisher.publish` to
  a real broker (AREAL_KAFKA_BOOTSTRAP, or one this benchmark starts), and with
  TensorBoard's `SummaryWriter.add_scalar` of the same scalars, interleaved;
- evaluation sharding: the work of each of `--ranks` ranks for one full
  stage (the default evaluation sets) when every rank evaluates everything
  (redundancy = ranks, the unsharded vote) and with redundancy 2: samples,
  generated tokens and CPU seconds per rank;
- two runs: two 2-rank runs side by side publishing to a real broker (the
  demo's budget).
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


def quiet_config(**changes: object):
    from areal_train.config import TrainConfig

    return TrainConfig(seed=0, eval_at_start=False, eval_every_steps=None, eval_at_end=False, publish=False,
                       checkpoint_every_steps=None, checkpoint_dir=tempfile.mkdtemp(prefix="bench-ckpt-"),
                       **changes)  # type: ignore[arg-type]


def timed_run(steps: int, sink: Callable[[Event], None], **changes: object) -> tuple[list[float], list[StepEvent], float]:
    """(intervals between step events in ms after warm-up, the step events, CPU seconds of the run)."""
    from areal_train.trainer import train

    stamps: list[float] = []
    events: list[StepEvent] = []

    def publish(event: Event) -> None:
        sink(event)
        if isinstance(event, StepEvent):
            stamps.append(time.perf_counter())
            events.append(event)

    cpu = time.process_time()
    train(quiet_config(**changes), f"bench-{uuid.uuid4().hex[:6]}", steps, publish=publish)
    cpu = time.process_time() - cpu
    intervals = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]
    return intervals[3:], events, cpu


def step_cost(steps: int) -> int:
    from areal_train.launch import prepare

    prepare(quiet_config())
    print(f"machine: {machine()}")
    rows = []
    for turns in (1, 2, 4):
        _, events, cpu = timed_run(steps, lambda e: None, max_turns=turns)
        tail = events[3:]
        wall = statistics.median(e.latency_ms for e in tail)
        tokens = statistics.fmean(e.tokens or 0 for e in tail)
        rows.append((f"mt{turns}: step wall p50 / CPU mean", f"{wall:.0f} / {cpu / steps * 1000:.0f} ms",
                     f"{tokens:.0f} generated tokens/step, {tokens * steps / cpu:.0f} per CPU s, "
                     f"reward {statistics.fmean(e.reward or 0 for e in tail):.2f}"))
    print_table(f"training step, 1 rank, {steps} steps each, 8 prompts x 4 episodes, warm start", rows)
    return 0


def eval_sharding(ranks: int) -> int:
    """One full stage of the default sets: work per rank, unsharded (every rank all) and with redundancy 2."""
    import torch

    from areal_train.evalsets import layout
    from areal_train.evaluation import evaluate_shard
    from areal_train.launch import prepare
    from areal_train.session import build_eval_sets
    from areal_train.warmstart import load, spec_for

    cfg = quiet_config()
    prepare(cfg)
    torch.set_num_threads(1)
    policy = load(spec_for(cfg)).eval()
    sets = build_eval_sets(cfg)
    print(f"machine: {machine()}")
    rows = []
    for redundancy in (ranks, 2):
        per_rank = []
        for rank in range(ranks):
            samples = tokens = 0
            cpu = time.process_time()
            for evalset in sets.values():
                shard = layout(len(evalset.problems), evalset.k, ranks, redundancy, rank)
                result = evaluate_shard(policy, evalset, shard, torch.device("cpu"))
                samples += len(result.verdicts)
                tokens += result.generated_tokens
            per_rank.append((samples, tokens, time.process_time() - cpu))
        label = "unsharded (every rank all)" if redundancy >= ranks else f"sharded, redundancy {redundancy}"
        rows.append((f"{label}: per rank samples / tokens / CPU s",
                     " | ".join(f"{s} / {t} / {c:.2f}" for s, t, c in per_rank),
                     f"mean CPU {statistics.fmean(c for _, _, c in per_rank):.2f} s"))
    print_table(f"one full evaluation stage ({', '.join(sets)}: {cfg.eval_size} prompts x {cfg.eval_samples} "
                f"samples each) on {ranks} ranks", rows)
    return 0


def publishing(steps: int, repeats: int, switch_interval: float | None) -> int:
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    from torch.utils.tensorboard import SummaryWriter

    from areal_train.launch import prepare
    from producers.publisher import Publisher
    from producers.topics import Topics

    prepare(quiet_config())
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
        timed_run(10, publisher.publish)  # warm up the producer connection and torch
        for _ in range(repeats):
            for mode, sink in sinks.items():
                times[mode] += timed_run(steps, sink)[0]
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
        rows.append((f"{label}: step p50 / mean", f"{med:.1f} / {statistics.fmean(times[mode]):.1f} ms", ratio))
    print_table(f"trainer step time, 1 rank, {steps} steps x {repeats} repeats per mode, interleaved", rows)
    print(f"\n  Kafka: {stats.sent + stats.resent} of {stats.queued} events acknowledged"
          f" ({'flushed' if flushed else 'NOT flushed'}), {stats.spilled} spilled to the journal")
    return 0


def two_runs(steps: int) -> int:
    """The demo's budget: two runs of 2 ranks each, side by side, publishing to a real broker."""
    import json
    import os

    from areal_metrics.stack.kafka_broker import create_topics
    from areal_train.launch import prepare, start
    from producers.topics import Topics

    print(f"machine: {machine()}")
    with broker() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        topics = Topics(f"bench{uuid.uuid4().hex[:6]}.")
        create_topics(bootstrap, topics.all(), partitions=3)
        env = dict(os.environ, AREAL_KAFKA_BOOTSTRAP=bootstrap, AREAL_TOPIC_PREFIX=topics.prefix,
                   AREAL_HOME=str(Path(tmp) / "home"))
        configs = {"mt4": quiet_config(max_turns=4, publish=True, eval_every_steps=10),
                   "mt2": quiet_config(max_turns=2, publish=True, eval_every_steps=10)}
        prepare(configs["mt4"])
        started = time.perf_counter()
        runs = [start(name, 2, steps, cfg, env=env, log_dir=Path(tmp) / "logs", summary_dir=Path(tmp) / name)
                for name, cfg in configs.items()]
        codes = [r.wait(1800) for r in runs]
        wall = time.perf_counter() - started
        print(f"\ntwo runs x 2 ranks x {steps} steps, side by side: {wall:.1f} s wall, exit {codes}")
        for name in configs:
            for path in sorted((Path(tmp) / name).glob("rank*.json")):
                s = json.loads(path.read_text())
                print(f"  {name} rank {s['rank']}: {s['seconds']:.1f} s, reward {s['first_reward']:.3f} -> "
                      f"{s['last_reward']:.3f}")
    return 0 if not any(codes) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_train")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval in seconds (default: Python's 5 ms)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--publishing", action="store_true", help="publishing off / Kafka / TensorBoard")
    mode.add_argument("--eval-sharding", action="store_true", help="evaluation work per rank, before and after")
    mode.add_argument("--two-runs", action="store_true", help="two 2-rank runs side by side")
    args = parser.parse_args(argv)
    if args.two_runs:
        return two_runs(args.steps or 60)
    if args.publishing:
        return publishing(args.steps or 100, args.repeats, args.switch_interval)
    if args.eval_sharding:
        return eval_sharding(args.ranks)
    return step_cost(args.steps or 30)


if __name__ == "__main__":
    raise SystemExit(main())
