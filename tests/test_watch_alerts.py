"""`watch` shows the newest alerts across runs, newest first (issue 44, item 2); without a terminal
it (and the demo's live view) prints what the terminal view shows, as lines (item 8).

Its "latest alerts" were the last 8 read from Kafka in partition order: the runs' alerts
arrive partition by partition, so a partition read last (holding older runs) pushed out the
newest run's alerts read before it. The fold keeps the newest by time, each alert once.
"""

from __future__ import annotations

import io
import random
import re

import pytest
from rich.console import Console

from areal_metrics.commands.watch import MAX_ALERTS, WatchState, render
from areal_metrics.producers.contract.events import AlertEvent
from areal_metrics.producers.contract.topics import Topics

T0 = 1_800_000_000.0


def alert(run_id: str, minute: int) -> AlertEvent:
    return AlertEvent(run_id=run_id, kind="stalled", message=f"{run_id} minute {minute}", ts=T0 + 60 * minute,
                      alert_id=f"{run_id}:{minute}")


def test_the_newest_alerts_across_runs_are_kept_whatever_the_order_they_are_read_in() -> None:
    new_run = [alert("new-run", m) for m in (50, 51, 52)]  # partition 0, read first
    old_runs = [alert(f"old-{i}", m) for i in range(3) for m in range(i * 10, i * 10 + 5)]  # partition 1, read last
    state = WatchState()
    for event in new_run + old_runs:
        state.apply(event)
    kept = [a.alert_id for a in state.alerts]
    newest = [a.alert_id for a in sorted(new_run + old_runs, key=lambda a: a.ts)[-MAX_ALERTS:]]
    assert kept == newest and {"new-run:50", "new-run:51", "new-run:52"} <= set(kept)

    shuffled = WatchState()
    events = new_run + old_runs + new_run[:1]  # one redelivered
    random.Random(7).shuffle(events)
    for event in events:
        shuffled.apply(event)
    assert [a.alert_id for a in shuffled.alerts] == newest


def test_the_view_lists_the_alerts_newest_first() -> None:
    state = WatchState()
    for event in (alert("b", 3), alert("a", 1), alert("c", 2)):
        state.apply(event)
    console = Console(file=io.StringIO(), width=220, record=True)
    console.print(render(state, now=T0 + 600))
    shown = re.findall(r"(\w) minute (\d)", console.export_text())
    assert shown == [("b", "3"), ("c", "2"), ("a", "1")]


# ------------------------------------------------------------------ without a terminal


def test_the_plain_view_shows_what_the_terminal_view_shows() -> None:
    """The demo without a terminal printed '... 26 s' lines with no content; now the runs' lines."""
    from areal_metrics.producers.contract.events import CommandEvent, EvalConsensusEvent, RewardSmoothedEvent, RunEvent
    from areal_metrics.commands.watch import plain_lines

    state = WatchState()
    state.apply(RunEvent(run_id="run-a", status="running", world_size=2, rank=0, ts=T0))
    state.apply(RewardSmoothedEvent(run_id="run-a", step=120, reward=0.6, window=10, sliding_avg=0.61, ema=0.625,
                                    slope=0.01, ts=T0 + 5))
    state.apply(EvalConsensusEvent(run_id="run-a", eval_id="e", step=100, dataset="add_1digit", stage="full",
                                   accuracy=0.8125, votes=2, replicas=2, agreement=1.0, ts=T0 + 6))
    state.apply(CommandEvent(run_id="run-a", command="set_eval_interval", args={"steps": 7}, ts=T0 + 7))
    state.apply(alert("run-a", 1))
    shown: set[str] = set()
    lines = plain_lines(state, T0 + 10, shown)
    assert lines[0] == ("  run-a: running 1/2 ranks, step 120, reward EMA 0.625 (sliding avg 0.610), "
                        "add_1digit: 81%@100, eval interval 7 steps, last command set_eval_interval {'steps': 7}, 3s ago")
    assert lines[1].startswith("  alert ") and lines[1].endswith("run-a warning stalled: run-a minute 1")
    console = Console(file=io.StringIO(), width=220, record=True)
    console.print(render(state, now=T0 + 10))
    terminal = console.export_text()
    for shown_there in ("running 1/2 ranks", "120", "0.625", "add_1digit: 81%@100", "7 steps", "run-a minute 1"):
        assert shown_there in terminal and shown_there in "\n".join(lines)
    assert plain_lines(state, T0 + 10, shown) == lines[:1]  # an alert is printed once


@pytest.mark.broker
def test_watch_without_a_terminal_prints_the_runs_lines(kafka_bootstrap: str, topics: Topics) -> None:
    from kafka import KafkaProducer

    from areal_metrics.commands.watch import watch_loop
    from areal_metrics.producers.contract.events import RewardSmoothedEvent
    from areal_metrics.producers.contract.settings import Settings

    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    events = [RewardSmoothedEvent(run_id="live-run", step=s, reward=s / 10, window=10, sliding_avg=s / 10, ema=s / 10,
                                  slope=0.01) for s in range(1, 6)]
    events.append(AlertEvent(run_id="live-run", kind="stalled", message="no steps for 30 s"))
    for e in events:
        producer.send(topics.for_event(e), key=e.run_id.encode(), value=e.to_json())
    producer.flush(30)
    producer.close()
    printed: list[str] = []
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topics.prefix)
    state = watch_loop(settings, ["live-run"], until=lambda: state_seen(printed), duration=120,
                       plain_every_s=0.2, out=printed.append)
    assert state.runs["live-run"].step == 5
    runs = [line for line in printed if line.startswith("  live-run: ")]
    assert runs and "step 5, reward EMA 0.500" in runs[-1], printed
    assert sum("stalled: no steps for 30 s" in line for line in printed) == 1, printed


def state_seen(printed: list[str]) -> bool:
    """Stop once a printed block shows the last step and the alert was printed."""
    return any("step 5, reward EMA 0.500" in line for line in printed) and any("stalled" in line for line in printed)
