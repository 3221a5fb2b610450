"""The current-figures table of docs/PERFORMANCE.md, from one `python -m benchmarks --quick --json FILE` run.

    python -m benchmarks.table FILE

Each row: the JSON key, its figure, the baseline measured in the same run or the target, and
what it measures. Keys a run did not write are left out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

# key, unit, what it measures, baseline key in the same run (or None), target (text, or "")
ROWS: list[tuple[str, str, str, str | None, str]] = [
    ("publish_us_p50", "us", "`Publisher.publish()` on the caller's thread, p50 (p99 below)", "raw_send_us_p50", "<= 10"),
    ("publish_us_p99", "us", "`Publisher.publish()`, p99", None, ""),
    ("client_log_us_p50", "us", "`run.log` of a 100-key step of Python floats, p50", "wandb_log_us_p50", "<= 20"),
    ("client_log_numpy_torch_us_p50", "us", "`run.log` of the same step as numpy and 0-d torch scalars (all steps' "
     "made before the timed loop: 80 MB), p50", "tensorboard_100_us_p50", "<= 20"),
    ("client_log_numpy_torch_fresh_us_p50", "us", "the same, each step's made just before its `log`, p50", None, ""),
    ("train_overhead_pct", "%", "step time of a CPU training step with `run.log` every step, against none",
     "tensorboard_overhead_pct", ""),
    ("pipeline_events_per_s", "ev/s", "publishers -> Kafka -> worker + sink -> rows, best phase", "raw_events_per_s", ""),
    ("pipeline_to_raw", "", "that rate over raw produce-then-consume on the same broker", None, ">= 0.6"),
    ("worker_cpu_us_per_event", "us", "stream worker CPU per step event, all phases", None, "<= 30"),
    ("sink_cpu_us_per_event", "us", "sink CPU per step event, all phases", None, ""),
    ("alert_latency_ms_p99", "ms", "`publish()` -> alert on the alerts topic, p99", None, "<= 250"),
    ("visible_latency_ms_p99", "ms", "`publish()` -> row visible to `sql`, p99", None, "<= 2000"),
    ("worker_rss_mib", "MiB", "stream worker peak RSS", None, ""),
    ("sink_rss_mib", "MiB", "sink peak RSS (the embedded ClickHouse engine included)", None, ""),
    ("panel_ms_p95_max", "ms", "slowest dashboard panel's p95 on 10M step rows", None, "<= 500"),
]


def figure(value: float, unit: str) -> str:
    if unit == "":
        return f"{value:.2f}"
    if unit == "%":
        return f"{value:+.1f} %"
    return f"{value:,.0f} {unit}" if abs(value) >= 100 else f"{value:.2f} {unit}"


def table(figures: dict[str, Any]) -> str:
    lines = ["| key | figure | same-run baseline | target | what |", "|---|---|---|---|---|"]
    for key, unit, what, baseline, target in ROWS:
        if key not in figures:
            continue
        base = f"{figure(figures[baseline], unit)} (`{baseline}`)" if baseline and baseline in figures else ""
        lines.append(f"| `{key}` | {figure(figures[key], unit)} | {base} | {target} | {what} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m benchmarks.table FILE", file=sys.stderr)
        return 2
    print(table(json.loads(Path(argv[0]).read_text())), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
