"""Record tests/data/golden/: the wire and state formats as today's code writes them.

    PYTHONPATH=. .venv/bin/python tests/data/make_golden.py

- events.jsonl: one event of each type with every field set, as `Event.to_json()` writes it;
- state.jsonl: a run's worker state after steps, an evaluation round and a run event, as the
  state codec writes it (RunState, JSON);
- table.jsonl: a busier run's state as the worker's table records (streams.state.state_store:
  a head, a waiting step, open and closed rounds), one `key<TAB>value` per line.

tests/test_golden.py reads them back with the current code and expects the same bytes out:
a change of records, validation or codec (msgspec, say) must keep both formats. Re-record
only for a deliberate, documented format change.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from areal_metrics.producers.contract.events import (  # noqa: E402
    AlertEvent,
    CommandAckEvent,
    CommandEvent,
    EvalConsensusEvent,
    EvalEvent,
    RejectedEvent,
    RewardSmoothedEvent,
    RunEvent,
    StepEvent,
)
from areal_metrics.streams.core.config import RunConfig  # noqa: E402
from areal_metrics.streams.core.processor import RunState, on_eval, on_rejected, on_run, on_step  # noqa: E402
from areal_metrics.streams.state import codec  # noqa: E402
from areal_metrics.streams.state.state_store import StateStore  # noqa: E402

HERE = Path(__file__).resolve().parent / "golden"
COMMON = dict(run_id="run-1", node="node-a", rank=1, ts=1700000000.5, event_id="e-0001")


def events() -> list:
    return [
        StepEvent(**COMMON, step=3, epoch=0.5, reward=0.25, reward_std=0.1, entropy=1.2, advantage_mean=0.0,
                  advantage_std=1.0, kl=0.01, clip_ratio=0.2, loss=0.5, lr=1e-3, grad_norm=0.7, response_length=4.0,
                  tokens=128, throughput=900.0, latency_ms=12.5, gpu_mem_bytes=1024,
                  metrics={"value_loss": 0.3, "critic/score/mean": 0.5}, world_size=2, attempt=1,
                  non_finite=("entropy_bonus",), n_samples=16),
        EvalEvent(**COMMON, eval_id="run-1:3:full", step=3, dataset="math_id", stage="full", accuracy=0.75,
                  response_length=2.0, reward=0.75, n_samples=4, latency_ms=30.0, verdicts=(1, 0, 1, 1),
                  sample_ids=(4, 5, 6, 7), shard_nodes=2, replicas=2, dataset_fingerprint="abc123",
                  metrics={"pass@4": 1.0, "maj@4": 0.75, "greedy_accuracy": 1.0},
                  samples=({"prompt": "2+2=", "response": "4", "verdict": 1, "reward": 1.0, "gold": "4",
                            "error_type": ""},), attempt=1),
        EvalEvent(**COMMON, eval_id="run-1:4:full", step=4, dataset="math_hard", status="failed", error="OOM"),
        EvalConsensusEvent(**COMMON, eval_id="run-1:3:full", step=3, dataset="math_id", accuracy=0.75, votes=3,
                           replicas=3, agreement=1.0, dissenters=("node-c",), stale=False, partial=True,
                           n_samples=4, n_undecided=0, ci_low=0.3, ci_high=0.95,
                           metrics={"pass@4": 1.0, "maj@4": 0.75}),
        RewardSmoothedEvent(**COMMON, step=3, reward=0.25, window=20, sliding_avg=0.2, ema=0.21, slope=0.01),
        CommandEvent(**COMMON, command="scale_lr", target_node="node-b", args={"factor": 0.5, "from_step": 7},
                     reason="upper bound 0.08 < threshold 0.1"),
        AlertEvent(**COMMON, alert_id="a-1", kind="eval_below_threshold", severity="critical",
                   message="math_id below 0.1", step=3, value=0.05, threshold=0.1),
        RejectedEvent(**COMMON, reason="steps.reward: not finite (nan)", source_topic="areal.steps", raw="{...}"),
        RunEvent(**COMMON, status="running", config={"lr": 1e-4, "eval_loop": {"threshold": 0.1}}, tags=("demo",),
                 group="mt4-grpo", world_size=2, host="h1", attempt=1, framework="torch", git_commit="abc",
                 name="mt4 grpo, seed 1"),
        CommandAckEvent(**COMMON, command_id="e-0001", command="scale_lr", status="applied", step=7, lr_factor=0.5,
                        detail="weights of step 4 restored (the newest kept at or before step 5)", attempt=1),
    ]


def state() -> RunState:
    cfg = RunConfig()
    s = RunState("run-1", partition=0)
    s, _ = on_run(s, RunEvent(run_id="run-1", node="n0", status="running", world_size=2, ts=1.0, event_id="r0",
                              config={"eval_interval_steps": 10}), 1.0, cfg)
    for step in range(6):
        for rank in range(2):
            s, _ = on_step(s, StepEvent(run_id="run-1", node=f"n{rank}", rank=rank, step=step, epoch=0,
                                        reward=0.1 * step + 0.01 * rank, world_size=2, ts=2.0 + step,
                                        event_id=f"s{step}-{rank}"), 2.0 + step, cfg)
    s, _ = on_eval(s, EvalEvent(run_id="run-1", node="n0", eval_id="run-1:5:full", step=5, dataset="math_id",
                                accuracy=0.5, n_samples=4, verdicts=(1, 0, 1, 0), replicas=2, ts=9.0,
                                event_id="v0"), 9.0, cfg)
    return s


def busy_state() -> RunState:
    """`state()` with a round closed (a last good consensus), another open, a step waiting for
    its second rank, a dead letter's memory and the run's own eval-loop settings."""
    cfg = RunConfig()
    s = state()
    s, _ = on_run(s, RunEvent(run_id="run-1", node="n1", rank=1, status="running", world_size=2, ts=9.2,
                              event_id="r1", config={"eval_loop": {"threshold": 0.2, "patience_rounds": 3}}), 9.2, cfg)
    s, _ = on_eval(s, EvalEvent(run_id="run-1", node="n1", rank=1, eval_id="run-1:5:full", step=5, dataset="math_id",
                                accuracy=0.75, n_samples=4, verdicts=(1, 0, 1, 1), replicas=2, ts=9.5,
                                metrics={"pass@1": 0.75}, event_id="v1"), 9.5, cfg)
    s, _ = on_eval(s, EvalEvent(run_id="run-1", node="n0", eval_id="run-1:6:quick", step=6, dataset="math_id",
                                stage="quick", accuracy=0.5, n_samples=2, verdicts=(1, 0), replicas=2, ts=10.0,
                                metrics={"greedy_accuracy": 0.5}, event_id="v2"), 10.0, cfg)
    s, _ = on_step(s, StepEvent(run_id="run-1", node="n0", rank=0, step=6, epoch=0, reward=0.6, world_size=2,
                                ts=10.5, event_id="s6-0"), 10.5, cfg)
    dead = RejectedEvent(run_id="run-1", node="n0", ts=11.0, event_id="d0", reason="steps.reward: not finite",
                         source_topic="areal.steps", raw="{}")
    s, _ = on_rejected(s, dead, "areal.steps/0/17", 11.0, cfg)
    return s


def table_lines(state: RunState) -> bytes:
    table: dict[bytes, bytes] = {}
    StateStore(table).save(state)
    return b"".join(key + b"\t" + value + b"\n" for key, value in table.items())


def main() -> int:
    HERE.mkdir(exist_ok=True)
    (HERE / "events.jsonl").write_bytes(b"".join(e.to_json() + b"\n" for e in events()))
    (HERE / "state.jsonl").write_bytes(codec.dumps(state()) + b"\n")
    (HERE / "table.jsonl").write_bytes(table_lines(busy_state()))
    print(f"wrote {HERE}/events.jsonl, state.jsonl and table.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
