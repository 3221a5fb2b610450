"""Draw the scale run's curves: `python -m benchmarks.scale_figure SCALE_JSON [--out docs/img/scaling.png]`.

Three panels from the JSON of `python -m benchmarks --scale`: the slowest dashboard panel's p95
against step rows (24 h of the newest run, 7 days of all runs; and the costliest panel's CPU
time, which a loaded machine does not stretch); the worker's CPU per event and
RSS against live runs (8 ranks each); the same against ranks per run (one run).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def is_per_rank(query: str) -> bool:
    """Efficiency's panels drawn per node and rank (and its rank table): raw rows before migration 11, v_rank_buckets
    since; the rest read v_step_means."""
    return query.startswith("efficiency") and "per run" not in query


def draw(figures: dict, out: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    panels = sorted(figures["panels"], key=lambda p: p["steps_rows"])
    rows = [p["steps_rows"] for p in panels]
    ax = axes[0]
    ax.plot(rows, [p["panel_ms_p95_max_24h"] for p in panels], "o-", label="wall p95, slowest: newest run, 24 h")
    ax.plot(rows, [p["panel_ms_p95_max_7d_all_runs"] for p in panels], "s-", label="wall p95, slowest: all runs, 7 days")
    for per_rank, marker, label in ((False, "^:", "per-step panels (v_step_means)"),
                                    (True, "v:", "per-rank panels")):
        cpu = [max(e["cpu_ms_p50"] for e in p["scenarios"]["every run, last 7 days"]
                   if e["kind"] == "panel" and is_per_rank(e["query"]) == per_rank) for p in panels]
        ax.plot(rows, cpu, marker, label=f"CPU p50, 7 days: {label}")
    ax.axhline(500, color="grey", ls="--", lw=1, label="goal 500 ms")
    ax.set_xscale("log")
    ax.set_xlabel(f"step rows ({panels[-1]['ranks']} ranks per run)")
    ax.set_ylabel("ms")
    top = max(max(p["panel_ms_p95_max_24h"], p["panel_ms_p95_max_7d_all_runs"]) for p in panels)
    ax.set_ylim(0, top * 1.75)  # room for the legend above the curves
    ax.set_title("Dashboard panels")
    ax.legend(fontsize=7)
    for ax, sweep, x, label in ((axes[1], figures["worker_runs_sweep"], "live_runs", "live runs (8 ranks each)"),
                                (axes[2], figures["worker_ranks_sweep"], "ranks", "ranks per run (1 run)")):
        xs = [w[x] for w in sweep]
        ax.plot(xs, [w["cpu_us_per_event"] for w in sweep], "o-", color="tab:blue", label="CPU per event")
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("worker CPU per event (us)", color="tab:blue")
        ax.set_ylim(bottom=0)
        twin = ax.twinx()
        twin.plot(xs, [w["rss_mib"] for w in sweep], "s--", color="tab:red", label="RSS")
        twin.set_ylabel("worker RSS (MiB)", color="tab:red")
        twin.set_ylim(bottom=0)
        ax.set_title(f"Stream worker core vs {label.split(' (')[0]}")
    load = figures.get("load_average_end", [float("nan")])[0]
    fig.suptitle(f"Scale run: {figures.get('command', '')}  ({figures.get('machine', '')}, shared: load average "
                 f"{load:.0f} at the end)", fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scale_figure", description=__doc__.splitlines()[0])
    parser.add_argument("json", type=Path)
    parser.add_argument("--out", type=Path, default=Path("docs/img/scaling.png"))
    args = parser.parse_args()
    draw(json.loads(args.json.read_text()), args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
