"""On the real broker: rank means, the step wait, a resumed attempt, the run lifecycle and the
closed loop on evaluation, through `python -m areal_metrics.streams` (helpers of tests/test_streams_e2e.py).

Runs:
- run-m, 2 ranks (world_size 2): rank 0 reports reward 0.0, rank 1 reward 1.0, so every
  step reads 0.5; at steps 5 and 6 rank 1's reward was NaN (null, `non_finite`), so those
  steps are rank 0's 0.0; at step 29 rank 1 never reports, and the step goes out at its
  wait (`step_wait_s`) as rank 0's 0.0. Full-stage math500 rounds at 10 (0.75), 20 (0.25:
  below the 0.5 threshold) and 28 (0.875: recovered), a quick round at 24 (0.0: not
  watched). Both ranks send `running` and `finished`.
- run-r, 1 rank: attempt 0 reports steps 0..9 at 0.2 and dies; attempt 1 resumes at step 5
  and reports 5..9 at 0.8, then `finished`.
- run-s, 1 rank: three steps, then silence and no run event: the one `stalled` alert.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.contract.events import EvalEvent, RunEvent, StepEvent
from areal_metrics.producers.contract.topics import Topics
from tests.test_streams_e2e import Msg, OutputReader, Worker, produce

pytestmark = pytest.mark.broker

T0 = 1_790_000_000.0
CONFIG = {
    "defaults": {
        "window": 5, "step_wait_s": 2.0, "stall_seconds": 3.0, "fast_slope": 1.0, "fast_exit_slope": 0.5,
        "evaluate_delta": 100.0, "vote_timeout_s": 600, "lr_eval_threshold": 0.5, "lr_restore_margin": 0.05,
        "lr_raise_after_rounds": 1,  # a raise after one round at the lower rate (default 3)
    },
    "tick_interval_s": 0.5,
}
# full stage, 64 samples: 0.75, 0.25 (far below 0.5: a cut), 0.875 (its interval above 0.55: a raise, to the
# ceiling x0.707 of the rate that dropped)
ROUNDS = {10: (1, 1, 1, 0) * 16, 20: (1, 0, 0, 0) * 16, 28: (1, 1, 1, 1, 1, 1, 1, 0) * 8}


def run_msg(topics: Topics, run: str, rank: int, status: str, world: int, attempt: int = 0) -> Msg:
    ev = RunEvent(run_id=run, node=f"n{rank}", rank=rank, status=status, world_size=world, attempt=attempt,
                  config={"eval_interval_steps": 25}, ts=T0, event_id=f"{run}-{status}-{rank}-{attempt}")
    return Msg(topics.runs, run.encode(), ev.to_json())


def step_msg(topics: Topics, run: str, rank: int, step: int, reward: float | None, *, world: int | None = None,
             attempt: int = 0) -> Msg:
    ev = StepEvent(run_id=run, node=f"n{rank}", rank=rank, step=step, epoch=0, reward=reward, world_size=world,
                   attempt=attempt, non_finite=("reward",) if reward is None else (), ts=T0 + step,
                   event_id=f"{run}-a{attempt}-s{step}-r{rank}")
    return Msg(topics.steps, run.encode(), ev.to_json())


def eval_msg(topics: Topics, node: str, step: int, verdicts: tuple[int, ...], stage: str = "full") -> Msg:
    ev = EvalEvent(run_id="run-m", node=node, eval_id=f"m-{stage}-{step}", step=step, dataset="math500", stage=stage,
                   accuracy=sum(verdicts) / len(verdicts), verdicts=verdicts, replicas=2, ts=T0 + step + 0.5,
                   event_id=f"m-{stage}-{step}-{node}")
    return Msg(topics.evals, b"run-m", ev.to_json())


def scenario(topics: Topics) -> list[Msg]:
    msgs = [run_msg(topics, "run-m", rank, "running", 2) for rank in (0, 1)]
    for step in range(30):
        msgs.append(step_msg(topics, "run-m", 0, step, 0.0, world=2))
        if step != 29:
            msgs.append(step_msg(topics, "run-m", 1, step, None if step in (5, 6) else 1.0, world=2))
        if step in ROUNDS:
            msgs += [eval_msg(topics, node, step, ROUNDS[step]) for node in ("n0", "n1")]
        if step == 24:
            msgs += [eval_msg(topics, node, step, (0, 0), stage="quick") for node in ("n0", "n1")]
    msgs += [run_msg(topics, "run-m", rank, "finished", 2) for rank in (1, 0)]
    msgs += [step_msg(topics, "run-r", 0, s, 0.2) for s in range(10)]
    msgs += [step_msg(topics, "run-r", 0, s, 0.8, attempt=1) for s in range(5, 10)]
    msgs.append(run_msg(topics, "run-r", 0, "finished", 1, attempt=1))
    msgs += [step_msg(topics, "run-s", 0, s, 0.5) for s in range(3)]
    return msgs


def latest(got: list[tuple[str, int, int, dict[str, Any]]], topic: str) -> dict[str, dict[str, Any]]:
    """Per event_id, the copy latest in the log (what a FINAL read keeps)."""
    out: dict[str, dict[str, Any]] = {}
    for t, _, _, v in got:
        if t == topic:
            out[v["event_id"]] = v
    return out


def test_ranks_resume_lifecycle_and_the_evaluation_loop_on_the_broker(
    kafka_bootstrap: str, topics: Topics, stack_env: dict[str, str], tmp_path: Path
) -> None:
    cfg = tmp_path / "streams.json"
    cfg.write_text(json.dumps(CONFIG))
    env = {**stack_env, "AREAL_STREAMS_CONFIG": str(cfg), "AREAL_STREAMS_SESSION_TIMEOUT": "6"}
    produce(kafka_bootstrap, scenario(topics))
    worker = Worker(env, tmp_path / "worker.log")
    reader = OutputReader(kafka_bootstrap, topics)
    worker.start()
    try:
        reader.wait_for({topics.smoothed: 30 + 10 + 3, topics.control: 2, topics.consensus: 4, topics.alerts: 3},
                        timeout=60)
        reader.settle(4.0)  # longer than stall_seconds: a `stalled` for the finished runs would show now
    finally:
        rc = worker.stop()
        reader.close()
    assert rc == 0, (tmp_path / "worker.log").read_text()[-3000:]

    smoothed = latest(reader.got, topics.smoothed).values()
    by_run: dict[str, dict[int, float]] = {}
    for s in smoothed:
        by_run.setdefault(s["run_id"], {})[s["step"]] = s["reward"]
    assert by_run["run-m"] == {s: 0.0 if s in (5, 6, 29) else 0.5 for s in range(30)}  # the mean, never rank 0 alone
    assert by_run["run-r"] == {s: 0.2 if s < 5 else 0.8 for s in range(10)}  # attempt 1 replaced 5..9
    assert by_run["run-s"] == {0: 0.5, 1: 0.5, 2: 0.5}
    m_points = [v for t, _, _, v in reader.got if t == topics.smoothed and v["run_id"] == "run-m"]
    assert len({v["event_id"] for v in m_points}) == 30  # one point per step, whatever was re-sent

    alerts = sorted((a["run_id"], a["kind"], a.get("step")) for a in latest(reader.got, topics.alerts).values())
    assert alerts == [("run-m", "eval_below_threshold", 20), ("run-m", "non_finite", 5), ("run-s", "stalled", 2)]

    commands = list(latest(reader.got, topics.control).values())
    assert [(c["command"], c["args"]) for c in commands] == [
        ("scale_lr", {"factor": 0.5, "from_step": 25}),
        ("scale_lr", {"factor": pytest.approx(2 ** 0.5), "from_step": 33})]
    assert all("target_node" not in c and "math500/full" in c["reason"] for c in commands)
    assert "accuracy 0.25 (95% CI [" in commands[0]["reason"] and "below threshold 0.5" in commands[0]["reason"]
    assert "CUSUM of the rounds' shortfall" in commands[0]["reason"]
    assert "the interval lies at or above threshold 0.5 + margin 0.05" in commands[1]["reason"]
