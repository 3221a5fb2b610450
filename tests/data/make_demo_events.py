"""Derive again the stream worker's events of tests/data/demo_events.jsonl.

    .venv/bin/python tests/data/make_demo_events.py [--out tests/data/demo_events.jsonl]

The file holds the events of two real short training runs recorded before issue 11
(two ranks each of the trainer of that time, a GRU on addition, captured from its
`publish` hook, with the `run` events and evaluation `samples` the client adds), then
everything today's stream worker derives from them. That trainer is gone, so its
events are kept as recorded (the Grafana tests need their shapes and faults, not a
particular policy), and this script feeds them again through the worker's logic
(`areal_metrics.streams.shell.batch.StreamCore`, what the worker runs for each batch), its clock set to each
event's time and ticking every second: the smoothed rewards, commands, consensus
results, alerts and dead letters are exactly what the worker derives now.
`tests/data/make_workload_events.py` records today's trainer for the report's tests.

The faults in the recording, so that every dashboard panel has something to show:
`demo-g4` failed its evaluation at one step on every rank (degraded mode, a stale
consensus); `demo-g2` has a dissenting replica, a reward threshold in the worker's config
(an alert) and its closed loop on evaluation (`scale_lr` while the `add_2digit`
consensus is below 0.5). Added here: one evaluation result of `demo-g2` is withheld from
the worker, as if the replica died (the round times out: a partial consensus), and two
malformed step messages are dead-lettered. Added for the evaluation details (issue 32), to
the recorded results once: `pass@1` and `maj@1` in `metrics` (the recording has one sample per
prompt, so both are the result's accuracy), and on each sample its `gold` (the sum its prompt
asks for) and `error_type` ("format" for an empty response, else "arithmetic"; "" when right).
Added for the trainers' acknowledgements (issue 41): each node of a run acknowledges each
`scale_lr` the worker sent at its first step at or past `from_step`, as `CommandApplier` does
(`command_ack` events, fed to the worker on the acks topic and kept in the file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from areal_metrics.producers.contract.events import (  # noqa: E402
    CommandAckEvent,
    CommandEvent,
    EvalEvent,
    RunEvent,
    StepEvent,
    parse_event,
)

RUNS = {
    # run id -> the worker's config overrides of that run
    "demo-g4": {},
    "demo-g2": {"reward_threshold": 0.05, "reward_cooldown_steps": 20, "lr_eval_threshold": 0.5,
                "lr_eval_dataset": "add_2digit"},
}
COMMON_STREAMS = {"window": 10, "min_eval_interval": 10, "eval_interval": 20, "interval_dwell_steps": 10, "adaptive_interval": True,
                  "evaluate_delta": 0.05, "vote_timeout_s": 30.0}
WITHHELD = ("demo-g2", 120, "add_2digit", "full", 1)  # run, step, dataset, stage, rank: never reaches the worker


# ------------------------------------------------ the stream worker's logic


def derive(trainer_events: list[bytes]) -> list[bytes]:
    """Feed the events through StreamCore; returns everything it emitted."""
    from areal_metrics.streams.core.config import RunConfig, StreamsConfig
    from tests.data.worker_replay import Replay

    defaults = RunConfig().with_overrides(COMMON_STREAMS)
    config = StreamsConfig(defaults=defaults, runs=tuple((run, cfg) for run, cfg in RUNS.items() if cfg))
    partition_of = {run: i for i, run in enumerate(RUNS)}
    replay = Replay(config, partition_of.values())
    topics = replay.topics

    acks: list[bytes] = []
    pending: dict[str, list[CommandEvent]] = {}  # node -> the scale_lr commands it has yet to apply
    factor: dict[str, float] = {}
    seen = [0]

    async def acknowledge(event: StepEvent) -> None:
        """The trainer of today acknowledges each `scale_lr` at its from_step (CommandApplier): every node."""
        for raw in replay.emitted[seen[0]:]:
            command = parse_event(raw)
            if isinstance(command, CommandEvent) and command.command == "scale_lr":
                for node in nodes[command.run_id]:
                    pending.setdefault(node, []).append(command)
        seen[0] = len(replay.emitted)
        due = [c for c in pending.get(event.node, ()) if c.run_id == event.run_id and
               int(c.args.get("from_step", 0)) <= event.step]
        for command in due:
            pending[event.node].remove(command)
            factor[event.node] = min(1.0, max(0.125, factor.get(event.node, 1.0) * float(command.args["factor"])))
            ack = CommandAckEvent(run_id=event.run_id, node=event.node, rank=event.rank, ts=event.ts,
                                  event_id=f"ack-{command.event_id}-{event.node}", command_id=command.event_id,
                                  command="scale_lr", status="applied", step=event.step, lr_factor=factor[event.node])
            acks.append(ack.to_json())
            await replay.put(topics.acks, partition_of[event.run_id], event.run_id.encode(), ack.to_json(), event.ts)

    nodes: dict[str, list[str]] = {}
    for raw in trainer_events:
        event = parse_event(raw)
        if isinstance(event, StepEvent) and event.node not in nodes.setdefault(event.run_id, []):
            nodes[event.run_id].append(event.node)

    async def feed() -> None:
        for raw in trainer_events:
            event = parse_event(raw)
            await replay.advance(event.ts)
            if _withheld(event) or isinstance(event, RunEvent):
                continue  # run events: the recording predates the worker reading the runs topic
            if isinstance(event, StepEvent):
                await acknowledge(event)
            partition, key = partition_of[event.run_id], event.run_id.encode()
            topic = topics.steps if isinstance(event, StepEvent) else topics.evals
            # the Kafka timestamp: the event's time (a dead letter's ts, so the file is the same on every run)
            await replay.put(topic, partition, key, raw, event.ts)
            if isinstance(event, StepEvent) and event.step in (50, 150) and event.rank == 0 and event.run_id == "demo-g2":
                await replay.put(topics.steps, partition, key, _malformed(event), event.ts)
        await replay.time_out(defaults.vote_timeout_s + 1)  # after the last event: open rounds time out

    asyncio.run(feed())
    return [*acks, *replay.emitted]


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


def _with_details(line: str) -> str:
    """A recorded eval result with the evaluation details (module docstring); others as they are."""
    data = json.loads(line)
    if data["type"] != "eval" or data.get("status") != "ok" or "pass@1" in data.get("metrics", {}):
        return line
    data["metrics"] = {**data.get("metrics", {}), "pass@1": data["accuracy"], "maj@1": data["accuracy"]}
    for sample in data.get("samples") or ():
        a, b = sample["prompt"].rstrip("=").split("+")
        sample["gold"] = str(int(a) + int(b))
        sample["error_type"] = "" if sample.get("verdict") == 1 else ("format" if not sample["response"] else "arithmetic")
    return json.dumps(data, separators=(",", ":"))


def rederive(path: Path) -> int:
    """The recorded trainer events again through today's stream worker logic (its rules changed since)."""
    lines = [_with_details(line).encode() for line in path.read_text().splitlines()
             if line and json.loads(line)["type"] in TRAINER_TYPES and json.loads(line)["node"] != "areal-streams"]
    derived = derive(lines)
    path.write_text("".join(raw.decode() + "\n" for raw in [*lines, *derived]))
    print(f"{path}: {len(lines)} trainer events kept, {len(derived)} derived again")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("demo_events.jsonl"))
    parser.add_argument("--rederive", action="store_true", help="(the only mode; kept for old command lines)")
    return rederive(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
