"""The trainer's costs: CPU per step, publishing beside TensorBoard, evaluation per rank with sharding.

    .venv/bin/python -m benchmarks.bench_train [--steps 30]            # CPU cost of a step (mt1, mt2, mt4)
    .venv/bin/python -m benchmarks.bench_train --publishing [--steps 100 --repeats 3]
    .venv/bin/python -m benchmarks.bench_train --eval-sharding [--ranks 4]
    .venv/bin/python -m benchmarks.bench_train --two-runs [--steps 60]

One rank in this process, on the cached warm start (built first if missing):

- step cost: wall and CPU seconds (this process) per training step, the
  generated tokens per step and the tokens per CPU second, for 1, 2 and 4
  attempts per episode; evaluations off, publishing off;
- publishing: the step time with publishing off, with the public client's
  `Run.log` to a real broker (AREAL_KAFKA_BOOTSTRAP, or one this benchmark
  starts), and with TensorBoard's `SummaryWriter.add_scalar` of the same
  values, interleaved;
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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from areal_metrics.areal_train.reporting import NullRun, RecordedRun, RunLike, RunSpec
from areal_metrics.areal_train.settings import TrainerSettings
from benchmarks.common import broker, machine, print_table

WARMSTARTS = TrainerSettings.from_env().warmstart_dir()  # the warm starts' cache (AREAL_CACHE_DIR), read once


def quiet_config(**changes: object):
    from areal_metrics.areal_train.config import TrainConfig

    return TrainConfig(seed=0, eval_at_start=False, eval_every_steps=None, eval_at_end=False, publish=False,
                       checkpoint_every_steps=None, checkpoint_dir=tempfile.mkdtemp(prefix="bench-ckpt-"),
                       **changes)  # type: ignore[arg-type]


class Timed(RecordedRun):
    """Records when each step is logged and hands every call on to `inner` (the client's run, TensorBoard, nothing)."""

    def __init__(self, inner: RunLike) -> None:
        super().__init__()
        self.inner = inner

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        super().log(metrics, step)
        self.inner.log(metrics, step)

    def log_eval(self, dataset: str, step: int | None = None, **fields: Any) -> None:
        self.inner.log_eval(dataset, step, **fields)

    def commands(self) -> list[Any]:
        return self.inner.commands()

    def finish(self, status: str | None = None, exit_code: int | None = None) -> None:
        super().finish(status, exit_code)
        self.inner.finish(status, exit_code)


class TensorBoardRun(NullRun):
    """The same numbers through TensorBoard's `SummaryWriter.add_scalar`, one call per value."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        for name, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(f"train/{name}", float(value), step)


def timed_run(steps: int, open_inner: Callable[[RunSpec], RunLike] | None = None,
              **changes: object) -> tuple[list[float], list[dict[str, Any]], float]:
    """(intervals between logged steps in ms after warm-up, the logged values, CPU seconds of the run)."""
    from areal_metrics.areal_train.trainer import train

    opened: list[Timed] = []

    def open_run(spec: RunSpec) -> RunLike:
        opened.append(Timed(open_inner(spec) if open_inner else NullRun()))
        return opened[-1]

    cpu = time.process_time()
    train(quiet_config(**changes), f"bench-{uuid.uuid4().hex[:6]}", steps, open_run=open_run, warmstarts=WARMSTARTS)
    cpu = time.process_time() - cpu
    stamps = [s.at for s in opened[0].steps]
    intervals = [(b - a) * 1000 for a, b in zip(stamps, stamps[1:])]
    return intervals[3:], [s.values for s in opened[0].steps], cpu


def step_cost(steps: int) -> int:
    from areal_metrics.areal_train.launch import prepare

    prepare(quiet_config(), WARMSTARTS)
    print(f"machine: {machine()}")
    rows = []
    for turns in (1, 2, 4):
        _, logged, cpu = timed_run(steps, max_turns=turns)
        tail = logged[3:]
        wall = statistics.median(v["latency_ms"] for v in tail)
        tokens = statistics.fmean(v["tokens"] for v in tail)
        rows.append((f"mt{turns}: step wall p50 / CPU mean", f"{wall:.0f} / {cpu / steps * 1000:.0f} ms",
                     f"{tokens:.0f} generated tokens/step, {tokens * steps / cpu:.0f} per CPU s, "
                     f"reward {statistics.fmean(v['reward'] for v in tail):.2f}"))
    print_table(f"training step, 1 rank, {steps} steps each, 8 prompts x 4 episodes, warm start", rows)
    return 0


def eval_sharding(ranks: int) -> int:
    """One full stage of the default sets: work per rank, unsharded (every rank all) and with redundancy 2."""
    import torch

    from areal_metrics.areal_train.evalsets import layout
    from areal_metrics.areal_train.evaluation import evaluate_shard
    from areal_metrics.areal_train.launch import prepare
    from areal_metrics.areal_train.session import build_eval_sets
    from areal_metrics.areal_train.warmstart import load, spec_for

    cfg = quiet_config()
    prepare(cfg, WARMSTARTS)
    torch.set_num_threads(1)
    policy = load(spec_for(cfg), cache=WARMSTARTS).eval()
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

    from areal_metrics.areal_train.launch import prepare
    from areal_metrics.areal_train.reporting import open_client_run

    prepare(quiet_config(), WARMSTARTS)
    print(f"machine: {machine()}; GIL switch interval {sys.getswitchinterval() * 1000:g} ms")
    times: dict[str, list[float]] = {"off": [], "kafka": [], "tensorboard": []}
    clients: list[Any] = []
    with broker() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        prefix = f"bench{uuid.uuid4().hex[:6]}."
        writer = SummaryWriter(log_dir=str(Path(tmp) / "tb"))

        def client(spec: RunSpec) -> RunLike:  # the public client, as the worker opens it
            clients.append(open_client_run(spec, kafka_bootstrap=bootstrap, topic_prefix=prefix, git=False,
                                           journal_dir=Path(tmp) / f"journal-{len(clients)}"))
            return clients[-1]

        opens: dict[str, Callable[[RunSpec], RunLike] | None] = {
            "off": None, "kafka": client, "tensorboard": lambda spec: TensorBoardRun(writer)}
        timed_run(10, client)  # warm up torch and the broker
        for _ in range(repeats):
            for mode, open_inner in opens.items():
                times[mode] += timed_run(steps, open_inner)[0]
        writer.close()
    stats = [c.stats() for c in clients[1:]]
    base = statistics.median(times["off"])
    rows = []
    for mode, label in (("off", "publishing off"), ("kafka", "areal_metrics client -> Kafka"),
                        ("tensorboard", "TensorBoard SummaryWriter")):
        med = statistics.median(times[mode])
        ratio = "1.00 (baseline)" if mode == "off" else f"{med / base:.3f} ({(med / base - 1) * 100:+.1f}%)"
        rows.append((f"{label}: step p50 / mean", f"{med:.1f} / {statistics.fmean(times[mode]):.1f} ms", ratio))
    print_table(f"trainer step time, 1 rank, {steps} steps x {repeats} repeats per mode, interleaved", rows)
    print(f"\n  Kafka: {sum(s.sent + s.resent for s in stats)} of {sum(s.queued for s in stats)} events acknowledged"
          f" by finish(), {sum(s.journaled for s in stats)} journaled")
    return 0


def two_runs(steps: int) -> int:
    """The demo's budget: two runs of 2 ranks each, side by side, publishing to a real broker."""
    import json
    import os

    from areal_metrics.stack.kafka_broker import create_topics
    from areal_metrics.areal_train.launch import prepare, start
    from areal_metrics.producers.contract.topics import Topics

    print(f"machine: {machine()}")
    with broker() as bootstrap, tempfile.TemporaryDirectory() as tmp:
        topics = Topics(f"bench{uuid.uuid4().hex[:6]}.")
        create_topics(bootstrap, topics.all(), partitions=3)
        env = dict(os.environ, AREAL_KAFKA_BOOTSTRAP=bootstrap, AREAL_TOPIC_PREFIX=topics.prefix,
                   AREAL_HOME=str(Path(tmp) / "home"))
        configs = {"mt4": quiet_config(max_turns=4, publish=True, eval_every_steps=10),
                   "mt2": quiet_config(max_turns=2, publish=True, eval_every_steps=10)}
        prepare(configs["mt4"], WARMSTARTS)
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
