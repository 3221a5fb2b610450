"""`watch`: the pure fold and view, and the live loop against the real broker."""

from __future__ import annotations

import io

import pytest
from kafka import KafkaProducer
from rich.console import Console

from areal_metrics.commands.watch import WatchState, evenly, render, sparkline, watch_loop
from areal_metrics.producers.contract.events import AlertEvent, CommandEvent, EvalConsensusEvent, RewardSmoothedEvent, RunEvent
from areal_metrics.producers.contract.settings import Settings


def smoothed(run_id: str, step: int, ema: float) -> RewardSmoothedEvent:
    return RewardSmoothedEvent(run_id=run_id, step=step, reward=ema, window=10, sliding_avg=ema, ema=ema, slope=0.01)


def consensus(run_id: str, step: int, dataset: str, accuracy: float, stage: str = "full", **kw) -> EvalConsensusEvent:
    return EvalConsensusEvent(run_id=run_id, eval_id=f"{run_id}:{step}:{dataset}:{stage}", step=step, dataset=dataset,
                              stage=stage, accuracy=accuracy, votes=2, replicas=2, agreement=1.0, **kw)


def text_of(renderable, width: int = 220) -> str:
    console = Console(file=io.StringIO(), width=width, record=True)
    console.print(renderable)
    return console.export_text()


def test_sparkline_scales_values_to_blocks() -> None:
    assert sparkline([0.0, 0.5, 1.0], lo=0.0, hi=1.0) == "▁▅█"
    assert sparkline([]) == ""
    assert len(sparkline([0.1] * 100, width=40)) == 40
    assert sparkline([2.0, -1.0], lo=0.0, hi=1.0) == "█▁"  # out of range values are clamped


def test_the_trend_spans_the_whole_run() -> None:
    assert evenly(list(range(100)), 5) == [0, 25, 50, 74, 99]
    assert evenly([1.0, 2.0], 5) == [1.0, 2.0]
    state = WatchState()
    for step in range(1, 5001):
        state.apply(smoothed("a", step, step / 5000))
    history = state.runs["a"].history
    assert len(history) <= 2000 and history[0] == 1 / 5000 and history[-1] > 0.99


def test_state_keeps_the_latest_of_each_thing_per_run() -> None:
    state = WatchState()
    for step, ema in ((1, 0.1), (2, 0.2), (3, 0.4)):
        state.apply(smoothed("a", step, ema))
    state.apply(consensus("a", 20, "add_1digit", 0.5))
    state.apply(consensus("a", 10, "add_1digit", 0.2))  # late, older round: does not replace
    state.apply(consensus("a", 20, "add_1digit", 0.25, stage="quick"))
    state.apply(consensus("a", 40, "add_1digit", 0.75))
    state.apply(CommandEvent(run_id="a", command="set_eval_interval", args={"steps": 5}))
    state.apply(AlertEvent(run_id="a", kind="eval_failed", severity="critical", message="round 7 failed"))
    run = state.runs["a"]
    assert run.step == 3 and run.ema == 0.4 and list(run.history) == [0.1, 0.2, 0.4]
    assert run.consensus[("add_1digit", "full")].accuracy == 0.75
    assert run.consensus[("add_1digit", "quick")].accuracy == 0.25
    assert run.eval_interval == 5 and run.observed_interval == 20
    assert [a.kind for a in state.alerts] == ["eval_failed"]


def test_runs_not_asked_for_are_left_out() -> None:
    state = WatchState(run_ids={"a"})
    state.apply(smoothed("b", 1, 0.5))
    state.apply(AlertEvent(run_id="b", kind="stalled", message="x"))
    assert state.runs == {} and not state.alerts


def test_render_shows_reward_accuracy_interval_and_alerts() -> None:
    state = WatchState()
    state.apply(smoothed("run-a", 120, 0.625))
    state.apply(consensus("run-a", 100, "add_2digit", 0.0, stale=True))
    state.apply(consensus("run-a", 100, "add_1digit", 0.8125))
    state.apply(CommandEvent(run_id="run-a", command="set_eval_interval", args={"steps": 7}))
    state.apply(AlertEvent(run_id="run-a", kind="reward_below_threshold", message="reward 0.1 < 0.2"))
    text = text_of(render(state, now=state.runs["run-a"].updated + 3))
    for expected in ("run-a", "120", "0.625", "add_1digit: 81%@100", "add_2digit: 0%@100", "stale", "7 steps",
                     "reward_below_threshold", "reward 0.1 < 0.2"):
        assert expected in text, expected


@pytest.mark.parametrize("width", [80, 100])
def test_the_view_is_readable_on_a_narrow_terminal(width: int) -> None:
    """Every value whole on one line, whatever the run id's length; no line wider than the terminal."""
    run_id = "grpo-qwen2.5-7b-instruct-lr1e-6-seed3"
    state = WatchState()
    state.apply(smoothed(run_id, 120, 0.625))
    state.apply(consensus(run_id, 100, "math500", 0.8125))
    state.apply(CommandEvent(run_id=run_id, command="set_eval_interval", args={"steps": 25}))
    state.apply(RunEvent(run_id=run_id, status="running", world_size=2))
    text = text_of(render(state, now=state.runs[run_id].updated + 3), width=width)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    for value in ("0.625", "120", "math500: 81%@100", "running 1/2 ranks", " 25 "):
        assert any(value in line for line in lines), (value, text)


def test_status_comes_from_the_run_events() -> None:
    state = WatchState()

    def run_event(rank: int, status: str, ts: float, attempt: int = 0) -> RunEvent:
        return RunEvent(run_id="run-b", node=f"h:{rank}", rank=rank, status=status, world_size=2, attempt=attempt, ts=ts)

    state.apply(smoothed("run-b", 3, 0.5))
    state.apply(run_event(0, "running", 1.0))
    assert "running 1/2 ranks" in text_of(render(state, now=10))
    state.apply(run_event(1, "running", 1.0))
    state.apply(run_event(1, "finished", 5.0))
    state.apply(run_event(0, "running", 2.0))  # a late duplicate of rank 0's start changes nothing
    assert state.runs["run-b"].state.status == "running"
    state.apply(run_event(0, "finished", 6.0))
    assert state.runs["run-b"].state.status == "finished" and "finished" in text_of(render(state, now=10))
    state.apply(run_event(0, "running", 9.0, attempt=1))
    state.apply(run_event(1, "running", 9.0, attempt=1))
    state.apply(run_event(1, "killed", 12.0, attempt=1))
    assert "killed (attempt 1)" in text_of(render(state, now=20))
    state.apply(smoothed("no-lifecycle", 1, 0.1))  # a producer without run events
    assert state.runs["no-lifecycle"].state is None


@pytest.mark.broker
def test_watch_loop_follows_the_derived_topics(kafka_bootstrap, topics) -> None:
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    events = [smoothed("live-run", s, s / 10) for s in range(1, 6)]
    events += [consensus("live-run", 5, "add_1digit", 0.5),
               AlertEvent(run_id="live-run", kind="stalled", message="no steps for 30 s"),
               smoothed("other-run", 1, 0.9)]
    for e in events:
        producer.send(topics.for_event(e), key=e.run_id.encode(), value=e.to_json())
    producer.send(topics.smoothed, key=b"live-run", value=b"{broken")
    producer.flush(30)
    producer.close()
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix)
    console = Console(file=io.StringIO(), width=220, record=True)
    state = watch_loop(settings, ["live-run"], duration=4.0, console=console, refresh_per_second=10)
    assert set(state.runs) == {"live-run"} and state.runs["live-run"].step == 5
    assert state.skipped == 1 and [a.kind for a in state.alerts] == ["stalled"]
    assert "add_1digit: 50%@5" in console.export_text()
