"""Regenerate tests/data/demo_events.jsonl: the events of a real short training run.

    .venv/bin/python tests/data/make_demo_events.py [--steps 200] [--out tests/data/demo_events.jsonl]
    .venv/bin/python tests/data/make_demo_events.py --rederive   # the worker's events only, again

The trainer recorded here is the one before issue 11 (a GRU on addition, its
`publish` hook): a full regeneration needs that trainer's code. `--rederive`
keeps its recorded events and feeds them through today's stream worker logic.

What it runs, all real code of this repository:

- two runs of the real trainer (`areal_train.trainer.train`: tiny GRU policy,
  GRPO on the addition task, evaluation rounds on two datasets, quick and full
  stage), group size 4 (`demo-g4`) and group size 2 (`demo-g2`), each as two
  ranks in two processes joined by torch.distributed (gloo); every event the
  trainer publishes is captured from its `publish` hook;
- the stream worker's per-message logic (`streams.app.StreamCore`, the code
  the Faust agents call), fed with those events in publish order, its clock
  set to each event's time and ticking every second, so the smoothed rewards,
  commands, consensus results, alerts and dead letters are exactly what the
  worker derives.

Faults, so that every dashboard panel has something to show: `demo-g4` fails
its evaluation at one step on every rank (the trainer's `fail_eval_at_steps`:
degraded mode, a stale consensus); `demo-g2` has a dissenting replica (the
trainer's `dissent_rank`), a reward threshold in the worker's config (an
alert) and its closed loop on evaluation (`scale_lr` while the `add_2digit`
consensus is below 0.5); one evaluation result of `demo-g2` is withheld from
the worker, as if the replica died (the round times out: a partial
consensus); two malformed step messages are dead-lettered.

The trainers are not wired to the control topic here (no broker), so they do
not obey the commands; the full loop is `areal-metrics demo`.

What the Python client adds to a trainer's events is added here the way the
client does it, for the trainer recorded here predates it: each rank's `run`
events (`running` before training, `finished` after, with the run's config,
tags and group), and the `samples` of each evaluation result (the first
SAMPLES_KEPT problems: the real prompt, the policy's real greedy answer, the
verdict published and its reward), captured around the trainer's
`evaluate_problems`.
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

from producers.events import EvalEvent, RunEvent, StepEvent, parse_event  # noqa: E402
from producers.topics import Topics  # noqa: E402

RUNS = {
    # run id -> (trainer config overrides, streams config overrides)
    "demo-g4": ({"group_size": 4, "fail_eval_at_steps": [100]}, {}),
    "demo-g2": ({"group_size": 2, "dissent_rank": 1}, {"reward_threshold": 0.05, "reward_cooldown_steps": 20,
                                                       "lr_eval_threshold": 0.5, "lr_eval_dataset": "add_2digit"}),
}
COMMON_TRAIN = {"eval_every_steps": 20, "eval_size": 32, "quick_size": 8, "batch_prompts": 16, "threads": 1,
                "device": "cpu", "publish": True, "seed": 3}
COMMON_STREAMS = {"window": 10, "min_eval_interval": 10, "eval_interval": 20, "interval_dwell_steps": 10,
                  "evaluate_delta": 0.05, "vote_timeout_s": 30.0}
WORLD_SIZE = 2
WITHHELD = ("demo-g2", 120, "add_2digit", "full", 1)  # run, step, dataset, stage, rank: never reaches the worker
GROUP = "demo"  # both runs: one comparison
TAGS = {"demo-g4": ("grpo", "group-4"), "demo-g2": ("grpo", "group-2")}
SAMPLES_KEPT = 4  # samples per evaluation result


def capture_answers() -> list[list[tuple[str, str]]]:
    """Wrap the trainer's `evaluate_problems` so each call also records (prompt, answer) per problem."""
    import torch

    from areal_train import evaluation
    from areal_train.policy import encode_prompts
    from areal_train.task import decode_response

    calls: list[list[tuple[str, str]]] = []
    real = evaluation.evaluate_problems

    @torch.no_grad()
    def recording(policy, problems, max_len, device, batch=512):  # type: ignore[no-untyped-def]
        answers = []
        for start in range(0, min(len(problems), SAMPLES_KEPT), batch):
            chunk = problems[start:start + batch][:SAMPLES_KEPT]
            rollout = policy.generate(encode_prompts(chunk, device), max_len, greedy=True)
            for problem, actions in zip(chunk, rollout.actions.tolist()):
                answers.append((problem.text, decode_response(actions) or ""))
        calls.append(answers)
        return real(policy, problems, max_len, device, batch)

    evaluation.evaluate_problems = recording
    return calls


def with_samples(event: EvalEvent, answers: list[tuple[str, str]]) -> EvalEvent:
    verdicts = event.verdicts or ()
    samples = [{"prompt": q, "response": a, "verdict": v, "reward": float(v)} for (q, a), v in zip(answers, verdicts)]
    return event.replace(samples=samples)  # type: ignore[return-value]


def lifecycle(run_id: str, rank: int, status: str, cfg: dict[str, object]) -> RunEvent:
    """The run event the client sends for this rank (see producers.client)."""
    import socket

    from areal_train.trainer import node_name

    return RunEvent(run_id=run_id, node=node_name(rank), rank=rank, status=status, config=cfg,
                    tags=TAGS[run_id], group=GROUP, world_size=WORLD_SIZE, host=socket.gethostname(),
                    framework="torch", exit_code=0 if status == "finished" else None)


# ----------------------------------------------------------- one rank (child)


def rank_main(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from areal_train.config import from_mapping
    from areal_train.trainer import train

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    cfg = from_mapping(json.loads(args.config_json))
    answers = capture_answers()
    with open(args.out, "w") as sink:
        def publish(event: object) -> None:
            if isinstance(event, EvalEvent) and event.status == "ok":
                event = with_samples(event, answers[-1])  # the stage's own evaluate_problems call
            sink.write(event.to_json().decode() + "\n")  # type: ignore[attr-defined]

        publish(lifecycle(args.run_id, rank, "running", cfg.to_dict()))
        train(cfg, args.run_id, args.steps, rank, WORLD_SIZE, publish=publish)
        publish(lifecycle(args.run_id, rank, "finished", cfg.to_dict()))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def run_training(run_id: str, overrides: dict[str, object], steps: int, workdir: Path, port: int) -> list[Path]:
    from areal_train.config import TrainConfig

    cfg = TrainConfig().replace(**COMMON_TRAIN, **overrides)
    outs, procs = [], []
    for rank in range(WORLD_SIZE):
        out = workdir / f"{run_id}-r{rank}.jsonl"
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(WORLD_SIZE), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        argv = [sys.executable, __file__, "--rank-worker", "--run-id", run_id, "--steps", str(steps),
                "--config-json", json.dumps(cfg.to_dict()), "--out", str(out)]
        procs.append(subprocess.Popen(argv, env=env))
        outs.append(out)
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"rank of {run_id} failed with exit status {p.returncode}")
    return outs


# ------------------------------------------------ the stream worker's logic


def derive(trainer_events: list[bytes]) -> list[bytes]:
    """Feed the events through StreamCore; returns trainer events + everything it emitted."""
    from streams.app import StreamCore
    from streams.config import RunConfig, StreamsConfig

    topics = Topics("areal.")
    defaults = RunConfig().with_overrides(COMMON_STREAMS)
    config = StreamsConfig(defaults=defaults, runs=tuple((run, cfg) for run, (_, cfg) in RUNS.items() if cfg))
    clock = [0.0]
    emitted: list[bytes] = []

    async def send(topic: str, key: bytes, value: bytes) -> asyncio.Future[None]:
        emitted.append(value)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    core = StreamCore(topics=topics, config=config, table={}, send=send, clock=lambda: clock[0])
    partition_of = {run: i for i, run in enumerate(RUNS)}
    offsets = {p: 0 for p in partition_of.values()}

    async def feed() -> None:
        next_tick = None
        for raw in trainer_events:
            event = parse_event(raw)
            clock[0] = event.ts
            if next_tick is None:
                next_tick = event.ts + 1
            while next_tick <= event.ts:  # the worker's timer, once a second
                for p in offsets:
                    await core.on_tick(p)
                next_tick += 1
            if _withheld(event):
                continue
            partition = partition_of[event.run_id]
            if isinstance(event, RunEvent):
                continue  # the stream worker does not read the runs topic
            topic = topics.steps if isinstance(event, StepEvent) else topics.evals
            # the Kafka timestamp: the event's time (a dead letter's ts, so the file is the same on every run)
            await core.on_input(topic, partition, offsets[partition], event.run_id.encode(), raw, event.ts)
            offsets[partition] += 1
            if isinstance(event, StepEvent) and event.step in (50, 150) and event.rank == 0 and event.run_id == "demo-g2":
                await core.on_input(topics.steps, partition, offsets[partition], event.run_id.encode(),
                                    _malformed(event), event.ts)
                offsets[partition] += 1
        # after the last event: the open rounds time out (partial consensus)
        clock[0] += defaults.vote_timeout_s + 1
        for p in offsets:
            await core.on_tick(p)

    asyncio.run(feed())
    return emitted


def _withheld(event: object) -> bool:
    if not isinstance(event, EvalEvent):
        return False
    return (event.run_id, event.step, event.dataset, event.stage, event.rank) == WITHHELD


def _malformed(event: StepEvent) -> bytes:
    """A step message a buggy producer might send: the reward as a string."""
    data = event.to_dict()
    data["event_id"] = f"malformed-{event.step}"
    data["reward"] = "0.5"
    return json.dumps(data).encode()


TRAINER_TYPES = ("step", "eval", "run")


def rederive(path: Path) -> int:
    """The recorded trainer events again through today's stream worker logic (its rules changed since)."""
    lines = [line.encode() for line in path.read_text().splitlines()
             if line and json.loads(line)["type"] in TRAINER_TYPES and json.loads(line)["node"] != "areal-streams"]
    derived = derive(lines)
    path.write_text("".join(raw.decode() + "\n" for raw in [*lines, *derived]))
    print(f"{path}: {len(lines)} trainer events kept, {len(derived)} derived again")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("demo_events.jsonl"))
    parser.add_argument("--rederive", action="store_true",
                        help="keep the recorded trainer events of --out, derive the worker's events again")
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-id", help=argparse.SUPPRESS)
    parser.add_argument("--config-json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_worker:
        return rank_main(args)
    if args.rederive:
        return rederive(args.out)

    from areal_train.launch import free_port

    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        files: list[Path] = []
        for run_id, (train_overrides, _) in RUNS.items():
            files += run_training(run_id, train_overrides, args.steps, Path(tmp), free_port())
        lines = [line.encode() for f in files for line in f.read_text().splitlines() if line]
    lines.sort(key=lambda raw: parse_event(raw).ts)  # publish order across ranks and runs
    derived = derive(lines)
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
