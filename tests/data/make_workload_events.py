"""Regenerate tests/data/workload_events.jsonl: the events of short real runs of the math workload.

    .venv/bin/python tests/data/make_workload_events.py [--steps 20] [--out tests/data/workload_events.jsonl]

What it runs, all real code of this repository:

- the real trainer (`areal_metrics.areal_train.trainer.train`: the warm-started transformer
  policy, GRPO, evaluation rounds on `math_id` and `math_hard`, two stages,
  the full stage sharded), as gloo ranks in separate processes, every event
  what the public client sent (its journal, no broker: tests/train_capture.py):
  - mt4-grpo (up to 4 attempts) and mt2-grpo (up to 2), seeds 1 and 2, 2 ranks
    each; the first run's third evaluation round fails on every rank;
  - two short throughput runs without evaluation, with 1 and 4 ranks;
- the stream worker's logic (`areal_metrics.streams.shell.batch.StreamCore`, through
  tests/data/worker_replay.py) fed with those events in publish order, its clock at each event's time and ticking
  every second, with the closed loop on evaluation switched on, so the
  smoothed rewards, consensus results, commands and alerts are what the
  worker derives.

The trainers are not wired to the control topic here (no broker): they do
not obey the worker's commands; the full loop is `areal-metrics demo`.
The warm start is the cached one (`areal_metrics.areal_train.warmstart`), built if missing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from areal_metrics.producers.contract.events import EvalEvent, RunEvent, StepEvent, parse_event

COMMON = {"eval_every_steps": 5, "eval_size": 32, "quick_size": 8, "eval_samples": 2, "threads": 1,
          "device": "cpu", "publish": True, "checkpoint_every_steps": None}
RUNS = {
    # run id -> (ranks, trainer config overrides)
    "wl-mt4-s1": (2, {"max_turns": 4, "seed": 1, "group": "mt4-grpo", "fail_eval_rounds": [3]}),
    "wl-mt4-s2": (2, {"max_turns": 4, "seed": 2, "group": "mt4-grpo"}),
    "wl-mt2-s1": (2, {"max_turns": 2, "seed": 1, "group": "mt2-grpo"}),
    "wl-mt2-s2": (2, {"max_turns": 2, "seed": 2, "group": "mt2-grpo"}),
}
THROUGHPUT = {"wl-tput-1r": 1, "wl-tput-4r": 4}  # run id -> ranks, no evaluation
STREAMS = {"window": 5, "min_eval_interval": 5, "eval_interval": 5, "interval_dwell_steps": 10, "vote_timeout_s": 30.0,
           "lr_eval_threshold": 0.5, "lr_eval_dataset": "math_hard", "lr_apply_delay_steps": 2,
           "no_improvement_rounds": 2}


def rank_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from areal_metrics.areal_train.config import from_mapping
    from areal_metrics.areal_train.settings import TrainerSettings
    from areal_metrics.areal_train.trainer import train
    from tests.train_capture import ClientCapture

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = from_mapping(json.loads(args.config_json))
    capture = ClientCapture(Path(args.out).with_suffix(".journals"))
    train(cfg, args.run_id, args.steps, rank, world, open_run=capture.open_run,
          warmstarts=TrainerSettings.from_env().warmstart_dir())
    with open(args.out, "w") as sink:
        for event in capture.events():
            sink.write(event.to_json().decode() + "\n")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def run_training(run_id: str, ranks: int, overrides: dict[str, object], steps: int, workdir: Path) -> list[Path]:
    from areal_metrics.areal_train.config import TrainConfig
    from areal_metrics.areal_train.launch import free_port, prepare
    from areal_metrics.areal_train.settings import TrainerSettings

    cfg = TrainConfig().replace(**{**COMMON, "checkpoint_dir": str(workdir / "ckpt"), **overrides})
    prepare(cfg, TrainerSettings.from_env().warmstart_dir())
    port = free_port()
    outs, procs = [], []
    for rank in range(ranks):
        out = workdir / f"{run_id}-r{rank}.jsonl"
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, __file__, "--rank-worker", "--run-id", run_id, "--steps", str(steps),
                "--config-json", json.dumps(cfg.to_dict()), "--out", str(out)]
        procs.append(subprocess.Popen(argv, env=env))
        outs.append(out)
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"rank of {run_id} failed with exit status {p.returncode}")
    return outs


def derive(trainer_events: list[bytes], partitions: dict[str, int]) -> list[bytes]:
    """Feed the events through StreamCore; returns everything it emitted."""
    from areal_metrics.streams.core.config import RunConfig, StreamsConfig
    from tests.data.worker_replay import Replay

    defaults = RunConfig().with_overrides(STREAMS)
    replay = Replay(StreamsConfig(defaults=defaults), set(partitions.values()))
    topics = replay.topics
    topic_of = {StepEvent: topics.steps, EvalEvent: topics.evals, RunEvent: topics.runs}

    async def feed() -> None:
        for raw in trainer_events:
            event = parse_event(raw)
            await replay.advance(event.ts)
            await replay.put(topic_of[type(event)], partitions[event.run_id], event.run_id.encode(), raw)
        await replay.time_out(max(defaults.vote_timeout_s, defaults.step_wait_s) + 1)  # open rounds and steps

    asyncio.run(feed())
    return replay.emitted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("workload_events.jsonl"))
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--config-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        return rank_main(args)

    started = time.time()
    quiet = {"eval_at_start": False, "eval_every_steps": None, "eval_at_end": False, "group": "throughput"}
    with tempfile.TemporaryDirectory() as tmp:
        files: list[Path] = []
        for run_id, (ranks, overrides) in RUNS.items():
            files += run_training(run_id, ranks, overrides, args.steps, Path(tmp))
        for run_id, ranks in THROUGHPUT.items():
            files += run_training(run_id, ranks, quiet, 6, Path(tmp))
        lines = [line.encode() for f in files for line in f.read_text().splitlines() if line]
    lines.sort(key=lambda raw: parse_event(raw).ts)  # publish order across ranks and runs
    partitions = {run: i % 3 for i, run in enumerate([*RUNS, *THROUGHPUT])}
    derived = derive(lines, partitions)
    with open(args.out, "w") as out:
        for raw in [*lines, *derived]:
            out.write(raw.decode() + "\n")
    kinds: dict[str, int] = {}
    for raw in [*lines, *derived]:
        kind = json.loads(raw)["type"]
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"{args.out}: {sum(kinds.values())} events {kinds} in {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
