"""`watch` shows the newest alerts across runs, newest first (issue 44, item 2).

Its "latest alerts" were the last 8 read from Kafka in partition order: the runs' alerts
arrive partition by partition, so a partition read last (holding older runs) pushed out the
newest run's alerts read before it. The fold keeps the newest by time, each alert once.
"""

from __future__ import annotations

import io
import random
import re

from rich.console import Console

from areal_metrics.commands.watch import MAX_ALERTS, WatchState, render
from areal_metrics.producers.contract.events import AlertEvent

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
