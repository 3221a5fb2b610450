"""The current-figures table of docs/PERFORMANCE.md, from one `python -m benchmarks --quick --json FILE` run.

    python -m benchmarks.table FILE

Each row: the JSON key, its figure, the baseline measured in the same run, its goal (met or
missed in this run: `GOALS`) and what it measures. Keys a run did not write are left out.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

@dataclass(frozen=True, slots=True)
class Goal:
    """A quick run's goal: `key` at most (or at least) `bound`, or `factor` times the same run's `of_key`
    (a ratio travels between machines where a figure in microseconds does not)."""

    key: str
    at_most: bool
    bound: float | None = None
    of_key: str | None = None
    factor: float = 1.0

    def limit(self, figures: dict[str, Any]) -> float | None:
        if self.of_key is None:
            return self.bound
        base = figures.get(self.of_key)
        return None if base is None else base * self.factor

    def text(self) -> str:
        sign = "<=" if self.at_most else ">="
        if self.of_key is None:
            return f"{sign} {self.bound:g}"
        return f"{sign} 1/{1 / self.factor:g} of `{self.of_key}`" if self.factor < 1 else f"{sign} {self.factor:g} x `{self.of_key}`"

    def met(self, figures: dict[str, Any]) -> bool | None:
        value, limit = figures.get(self.key), self.limit(figures)
        if value is None or limit is None:
            return None
        return value <= limit if self.at_most else value >= limit


# The quick run's goals (issue 42 raised four of them), checked on every run: `python -m benchmarks --quick`
# prints each one met or missed, and its JSON holds them under "goals".
GOALS: tuple[Goal, ...] = (
    Goal("publish_us_p50", at_most=True, bound=10),
    Goal("client_log_us_p50", at_most=True, bound=20),
    Goal("client_log_numpy_torch_us_p50", at_most=True, of_key="wandb_log_us_p50", factor=1 / 20),
    Goal("pipeline_to_raw", at_most=False, bound=0.8),
    Goal("worker_cpu_us_per_event", at_most=True, bound=30),
    Goal("alert_latency_ms_p99", at_most=True, bound=250),
    Goal("visible_latency_ms_p99", at_most=True, bound=250),
    Goal("panel_ms_p95_max", at_most=True, bound=500),
)
GOALS_BY_KEY = {g.key: g for g in GOALS}


def goals(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal with its figure, its limit in this run, and whether the run met it (None: not measured)."""
    return [{"key": g.key, "goal": g.text(), "figure": figures.get(g.key), "limit": g.limit(figures),
             "met": g.met(figures)} for g in GOALS]


def target(key: str, figures: dict[str, Any]) -> str:
    g = GOALS_BY_KEY.get(key)
    if g is None:
        return ""
    met = g.met(figures)
    return g.text() + ("" if met is None else ": met" if met else ": **missed**")


# key, unit, what it measures, baseline key in the same run (or None)
ROWS: list[tuple[str, str, str, str | None]] = [
    ("publish_us_p50", "us", "`Publisher.publish()` on the caller's thread, p50 (p99 below)", "raw_send_us_p50"),
    ("publish_us_p99", "us", "`Publisher.publish()`, p99", None),
    ("client_log_us_p50", "us", "`run.log` of a 100-key step of Python floats, p50", "wandb_log_us_p50"),
    ("client_log_numpy_torch_us_p50", "us", "`run.log` of the same step as numpy and 0-d torch scalars (all steps' "
     "made before the timed loop: 80 MB), p50", "tensorboard_100_us_p50"),
    ("client_log_numpy_torch_fresh_us_p50", "us", "the same, each step's made just before its `log`, p50", None),
    ("train_overhead_pct", "%", "step time of a CPU training step with `run.log` every step, against none",
     "tensorboard_overhead_pct"),
    ("pipeline_events_per_s", "ev/s", "publishers -> Kafka -> worker + sink -> rows, best phase", "raw_events_per_s"),
    ("pipeline_to_raw", "", "that rate over raw produce-then-consume on the same broker", None),
    ("worker_cpu_us_per_event", "us", "stream worker CPU per step event, all phases", None),
    ("sink_cpu_us_per_event", "us", "sink CPU per step event, all phases", None),
    ("machine_cpu_us_per_event", "us", "the whole machine's CPU per step event (publishers, broker, worker, "
     "sink), all phases", None),
    ("alert_latency_ms_p99", "ms", "`publish()` -> alert on the alerts topic, p99", None),
    ("visible_latency_ms_p99", "ms", "`publish()` -> row visible to `sql`, p99", None),
    ("worker_rss_mib", "MiB", "stream worker peak RSS", None),
    ("sink_rss_mib", "MiB", "sink peak RSS (the embedded ClickHouse engine included)", None),
    ("panel_ms_p95_max", "ms", "slowest dashboard panel's p95 on 10M step rows", None),
]


def figure(value: float, unit: str) -> str:
    if unit == "":
        return f"{value:.2f}"
    if unit == "%":
        return f"{value:+.1f} %"
    return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"


def table(figures: dict[str, Any]) -> str:
    lines = ["| key | figure | same-run baseline | goal | what |", "|---|---|---|---|---|"]
    for key, unit, what, baseline in ROWS:
        if key not in figures:
            continue
        base = f"{figure(figures[baseline], unit)} (`{baseline}`)" if baseline and baseline in figures else ""
        lines.append(f"| `{key}` | {figure(figures[key], unit)} | {base} | {target(key, figures)} | {what} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.table FILE", file=sys.stderr)
        return 2
    print(table(json.loads(Path(argv[0]).read_text())), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
