"""Per-rank figures of the step rows that the sink's per-rank aggregates (sinks/rank_aggregates.py)
and the efficiency board's raw-row queries (grafana/efficiency.py) both compute: one rule each, so a
panel's line does not jump where the board switches between the two (docs/CLICKHOUSE.md
"Per-rank aggregates")."""

from __future__ import annotations

BUCKET_STEPS = 64  # steps per bucket of the per-rank aggregates: one bit each in `step_bits`
# the columns the per-rank panels average: the aggregates keep a count and a sum of each
SUMMED = ("throughput", "latency_ms", "tokens")


def memory_sql(row: str = "") -> str:
    """A rank's memory in a step row (`row`: a table alias, e.g. "s"): the accelerator's, else on a
    CPU-only host the process RSS the trainer reports in metrics['mem_bytes']."""
    p = f"{row}." if row else ""
    return f"ifNull(toFloat64({p}gpu_mem_bytes), {p}metrics['mem_bytes'])"
