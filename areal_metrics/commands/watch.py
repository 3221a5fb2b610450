"""`watch`: a live terminal view of running runs, fed from the derived topics.

Per run: its status (from its `run` events: running, finished, failed,
killed, and the attempt), the smoothed reward with a sparkline, the latest
consensus accuracy per dataset (quick and full stage), the evaluation
interval, and the latest alerts. The state is a pure fold over events (`WatchState.apply`), the view a
pure function of it (`render` on a terminal; `plain_lines` without one: the same
content as lines of text, printed every few seconds), and `watch_loop` only moves
messages from Kafka into the state and the state onto the screen.
"""

from __future__ import annotations

import argparse
import bisect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from areal_metrics.producers.contract.events import (
    AlertEvent,
    CommandEvent,
    EvalConsensusEvent,
    Event,
    RewardSmoothedEvent,
    RunEvent,
)
from areal_metrics.producers.contract.run_status import RunState, fold
from areal_metrics.commands.arguments import seconds

SPARK = "▁▂▃▄▅▆▇█"
SPARK_POINTS = 40
MAX_ALERTS = 8
MAX_HISTORY = 2000


def sparkline(values: list[float], width: int = SPARK_POINTS, lo: float | None = None, hi: float | None = None) -> str:
    """The last `width` values as block characters, scaled to [lo, hi] (default: their range)."""
    values = values[-width:]
    if not values:
        return ""
    lo = min(values) if lo is None else lo
    hi = max(values) if hi is None else hi
    span = hi - lo
    if span <= 0:
        return SPARK[len(SPARK) // 2] * len(values) if lo != 0 else SPARK[0] * len(values)
    return "".join(SPARK[min(int((min(max(v, lo), hi) - lo) / span * (len(SPARK) - 1) + 0.5), len(SPARK) - 1)]
                   for v in values)


def evenly(values: list[float], n: int) -> list[float]:
    """At most `n` values spread evenly over `values`, the first and the last included."""
    if len(values) <= n:
        return list(values)
    return [values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)]


@dataclass
class DatasetView:
    step: int
    accuracy: float
    agreement: float
    votes: int
    replicas: int
    stale: bool
    partial: bool


@dataclass
class RunView:
    run_id: str
    step: int = 0
    reward: float | None = None
    sliding_avg: float | None = None
    ema: float | None = None
    slope: float | None = None
    history: list[float] = field(default_factory=list)  # the EMA over the whole run, thinned as it grows
    consensus: dict[tuple[str, str], DatasetView] = field(default_factory=dict)  # (dataset, stage) -> latest
    eval_steps: list[int] = field(default_factory=list)
    eval_interval: int | None = None  # from the last set_eval_interval command
    last_command: str | None = None
    updated: float = 0.0
    # per (attempt, rank, node): the event that decides that rank's status (the same rule as v_runs)
    lifecycle: dict[tuple[int, int, str], RunEvent] = field(default_factory=dict)

    @property
    def state(self) -> RunState | None:
        return fold(self.lifecycle.values()).get(self.run_id) if self.lifecycle else None

    @property
    def observed_interval(self) -> int | None:
        steps = sorted(set(self.eval_steps))
        return steps[-1] - steps[-2] if len(steps) >= 2 else None


@dataclass
class WatchState:
    run_ids: set[str] | None = None  # None: every run seen
    runs: dict[str, RunView] = field(default_factory=dict)
    # the newest MAX_ALERTS alerts by time, oldest first, each once: the log's partitions arrive in
    # any order (one partition's old alerts after another's new ones), and a redelivered alert is one
    alerts: list[AlertEvent] = field(default_factory=list)
    events: int = 0
    skipped: int = 0

    def apply(self, event: Event) -> None:
        if self.run_ids is not None and event.run_id not in self.run_ids:
            return
        self.events += 1
        if isinstance(event, AlertEvent):
            self._add_alert(event)
            return
        run = self.runs.setdefault(event.run_id, RunView(event.run_id))
        run.updated = max(run.updated, event.ts)
        if isinstance(event, RewardSmoothedEvent):
            if event.step >= run.step:
                run.step, run.reward, run.sliding_avg, run.ema, run.slope = (
                    event.step, event.reward, event.sliding_avg, event.ema, event.slope)
            run.history.append(event.ema)
            if len(run.history) > MAX_HISTORY:
                run.history = run.history[::2]  # keep the run's whole shape in bounded memory
        elif isinstance(event, EvalConsensusEvent):
            key = (event.dataset, event.stage)
            current = run.consensus.get(key)
            if current is None or event.step >= current.step:
                run.consensus[key] = DatasetView(event.step, event.accuracy, event.agreement, event.votes,
                                                 event.replicas, event.stale, event.partial)
            run.eval_steps.append(event.step)
            del run.eval_steps[:-20]
        elif isinstance(event, RunEvent):
            key = (event.attempt, event.rank, event.node)
            held = run.lifecycle.get(key)
            if held is None or (event.status != "running", event.ts) >= (held.status != "running", held.ts):
                run.lifecycle[key] = event
        elif isinstance(event, CommandEvent):
            run.last_command = event.command + (f" {dict(event.args)}" if event.args else "")
            if event.command == "set_eval_interval":
                run.eval_interval = int(event.args["steps"])

    def _add_alert(self, alert: AlertEvent) -> None:
        keys = [(a.ts, a.alert_id) for a in self.alerts]
        key = (alert.ts, alert.alert_id)
        if len(self.alerts) >= MAX_ALERTS and key <= keys[0]:
            return  # older than every alert shown
        if any(a.alert_id == alert.alert_id for a in self.alerts):
            return
        self.alerts.insert(bisect.bisect(keys, key), alert)
        del self.alerts[:-MAX_ALERTS]


WIDE = 150  # columns from which the view shows every column; narrower terminals get the compact one


def render(state: WatchState, now: float | None = None) -> Any:
    """The view of `state` as a rich renderable; it lays itself out for the console's width (80 columns up)."""
    return _View(state, time.time() if now is None else now)


class _View:
    def __init__(self, state: WatchState, now: float) -> None:
        self.state, self.now = state, now

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield _layout(self.state, self.now, options.max_width)


def _layout(state: WatchState, now: float, width: int) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    wide = width >= WIDE
    runs = Table(title="areal-metrics: runs", expand=True)
    names = (("run", "status", "step", "reward (EMA)", "sliding avg", "trend", "datasets: accuracy (full / quick)",
              "eval interval", "last command", "age") if wide else
             ("run", "status", "step", "EMA", *(("trend",) if width >= 100 else ()), "accuracy (full)", "interval"))
    for name in names:
        if name == "run":
            runs.add_column(name, overflow="fold", ratio=2)  # a long id folds; the values never shrink
        elif name in ("datasets: accuracy (full / quick)", "accuracy (full)", "last command"):
            runs.add_column(name, ratio=3)
        else:
            runs.add_column(name, no_wrap=True)
    for run in sorted(state.runs.values(), key=lambda r: r.run_id):
        interval = (f"{run.eval_interval} steps" if run.eval_interval is not None else
                    f"~{run.observed_interval} steps (seen)" if run.observed_interval else "-")
        if wide:
            runs.add_row(run.run_id, _status(run.state), str(run.step), _fmt(run.ema), _fmt(run.sliding_avg),
                         Text(sparkline(evenly(run.history, SPARK_POINTS), lo=0.0, hi=1.0), style="green"),
                         "\n".join(_accuracy_lines(run, detail=True)) or "-", interval, run.last_command or "-",
                         f"{max(now - run.updated, 0):.0f}s" if run.updated else "-")
            continue
        trend = (Text(sparkline(evenly(run.history, 12), width=12, lo=0.0, hi=1.0), style="green"),) if width >= 100 else ()
        runs.add_row(run.run_id, _status(run.state), str(run.step), _fmt(run.ema), *trend,
                     "\n".join(_accuracy_lines(run, detail=False)) or "-",
                     interval.replace(" steps (seen)", " seen").replace(" steps", ""))
    alerts = Table(title="latest alerts", expand=True)
    for name in ("time", "run", "severity", "kind", "message"):
        alerts.add_column(name, no_wrap=name in ("time", "severity"), overflow="fold")
    styles = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
    for a in reversed(state.alerts):
        alerts.add_row(time.strftime("%H:%M:%S", time.localtime(a.ts)), a.run_id,
                       Text(a.severity, style=styles.get(a.severity, "")), a.kind, a.message)
    footer = Text(f"{state.events} events read" + (f", {state.skipped} invalid skipped" if state.skipped else ""),
                  style="dim")
    return Group(runs, alerts, footer)


def plain_lines(state: WatchState, now: float, shown_alerts: set[str] | None = None) -> list[str]:
    """What the terminal view shows, as lines of text for a log or a pipe: one line per run, then the
    alerts not printed before (`shown_alerts`: their ids, updated)."""
    lines = []
    for run in sorted(state.runs.values(), key=lambda r: r.run_id):
        parts = [_plain_status(run.state), f"step {run.step}"]
        if run.ema is not None:
            parts.append(f"reward EMA {_fmt(run.ema)} (sliding avg {_fmt(run.sliding_avg)})")
        parts += _accuracy_lines(run, detail=False)
        interval = (f"{run.eval_interval} steps" if run.eval_interval is not None else
                    f"~{run.observed_interval} steps (seen)" if run.observed_interval else None)
        if interval:
            parts.append(f"eval interval {interval}")
        if run.last_command:
            parts.append(f"last command {run.last_command}")
        if run.updated:
            parts.append(f"{max(now - run.updated, 0):.0f}s ago")
        lines.append(f"  {run.run_id}: {', '.join(parts)}")
    for a in state.alerts:
        if shown_alerts is None or a.alert_id not in shown_alerts:
            lines.append(f"  alert {time.strftime('%H:%M:%S', time.localtime(a.ts))} {a.run_id} {a.severity} "
                         f"{a.kind}: {a.message}")
            if shown_alerts is not None:
                shown_alerts.add(a.alert_id)
    return lines


def _plain_status(state: RunState | None) -> str:
    if state is None:
        return "-"
    label = state.status
    if state.status == "running" and state.ranks < state.world_size:
        label += f" {state.ranks}/{state.world_size} ranks"
    return label + (f" (attempt {state.attempt})" if state.attempt else "")


def _accuracy_lines(run: RunView, detail: bool) -> list[str]:
    """One line per dataset: full / quick with votes and agreement (`detail`), else the full stage alone."""
    lines = []
    for d in sorted({d for d, _ in run.consensus}):
        parts = []
        for stage in ("full", "quick") if detail else ("full",):
            v = run.consensus.get((d, stage))
            if v is None:
                parts.append("-")
                continue
            flags = (" stale" if v.stale else "") + (" partial" if v.partial else "")
            votes = f" ({v.votes}/{v.replicas}, agree {v.agreement:.0%})" if detail else ""
            parts.append(f"{v.accuracy:.0%}@{v.step}{votes}{flags}")
        lines.append(f"{d}: {' / '.join(parts)}")
    return lines


STATUS_STYLES = {"running": "cyan", "finished": "green", "failed": "bold red", "killed": "yellow"}


def _status(state: RunState | None) -> Any:
    """`finished`, `running 1/2 ranks`, `failed (attempt 2)`...; `-` for a run that sent no run events."""
    from rich.text import Text

    if state is None:
        return "-"
    return Text(_plain_status(state), style=STATUS_STYLES.get(state.status, ""))


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def watch_loop(settings: Any, run_ids: list[str] | None = None, duration: float | None = None, *,
               console: Any = None, from_beginning: bool = True, refresh_per_second: float = 4.0,
               until: Callable[[], bool] | None = None, plain_every_s: float | None = None,
               out: Callable[[str], None] | None = None) -> WatchState:
    """Follow the derived topics (and the runs topic) and redraw until `duration` passes (forever if None), `until()`
    returns True (checked between polls; e.g. "the training runs have ended"), or Ctrl-C.

    With `plain_every_s` (no terminal: a log, a pipe), no live view: every that many seconds, and at the
    end, `plain_lines` are printed (to `out`, default stdout), with a header giving the elapsed time."""
    from kafka import KafkaConsumer

    from areal_metrics.producers.contract.events import ValidationError, parse_event
    from areal_metrics.producers.runtime.kafka_wait import closed_on_failure, quick_bootstrap

    topics = settings.topics
    state = WatchState(set(run_ids) if run_ids else None)
    # a bootstrap that gives up in 5 s (kafka-python's waits 30), and leaves no I/O thread when it does
    consumer = closed_on_failure(KafkaConsumer, **quick_bootstrap(settings.kafka_python_config()), group_id=None,
                                 enable_auto_commit=False, auto_offset_reset="earliest" if from_beginning else "latest")
    consumer.subscribe([topics.smoothed, topics.consensus, topics.control, topics.alerts, topics.runs])
    started = time.monotonic()
    deadline = None if duration is None else started + duration

    def follow(redraw: Callable[[], None]) -> None:
        while (deadline is None or time.monotonic() < deadline) and not (until and until()):
            batch = consumer.poll(timeout_ms=250)
            for records in batch.values():
                for record in records:
                    try:
                        state.apply(parse_event(record.value))
                    except ValidationError:
                        state.skipped += 1  # the stream worker dead-letters these; the view just skips
            redraw()

    try:
        if plain_every_s is None:
            from rich.live import Live

            with Live(render(state), console=console, refresh_per_second=refresh_per_second, transient=False) as live:
                follow(lambda: live.update(render(state)))
        else:
            write = out or (lambda line: print(line, flush=True))
            shown: set[str] = set()
            last = [started]

            def show(final: bool = False) -> None:
                if not final and time.monotonic() - last[0] < plain_every_s:
                    return
                last[0] = time.monotonic()
                write(f"--- {last[0] - started:.0f} s: {len(state.runs)} runs, {state.events} events read")
                for line in plain_lines(state, time.time(), shown):
                    write(line)

            follow(show)
            show(final=True)
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()
    return state


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--run", dest="runs", action="append", default=[], metavar="ID",
                        help="only these runs (repeatable)")
    parser.add_argument("--duration", type=seconds, default=None, help="stop after this many seconds (default: Ctrl-C)")
    parser.add_argument("--new", action="store_true", help="start from now instead of the beginning of the log")
    parser.add_argument("--every", type=seconds, default=10.0, metavar="S",
                        help="without a terminal (a pipe, a log): print the runs every S seconds (default 10)")


def run(args: argparse.Namespace) -> int:
    from kafka.errors import KafkaError

    from areal_metrics.errors import ServiceUnavailable, UserError
    from areal_metrics.producers.contract.settings import Settings

    settings = Settings.from_env()
    plain = None if sys.stdout.isatty() else args.every  # a pipe or a log gets lines, not screen redraws
    try:
        watch_loop(settings, args.runs or None, args.duration, from_beginning=not args.new, plain_every_s=plain)
    except KafkaError as exc:
        raise ServiceUnavailable(f"Kafka at {settings.kafka_bootstrap}: {exc} "
                                 "(start the stack with `areal-metrics up`)") from None
    return 0
