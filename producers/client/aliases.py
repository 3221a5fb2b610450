"""Metric names of the common RL frameworks -> the typed columns of a step (data; the columns, their
integers and bounds derive from `StepEvent`).

`run.log({...})` stores a key listed here in its typed column (scaled to the
column's unit), every other key in `metrics` under its own name. The names
are the ones the frameworks log:

- TRL (GRPOTrainer's `on_log`): reward, reward_std, kl, entropy,
  clip_ratio/region_mean, completions/mean_length, learning_rate, grad_norm,
  loss, step_time (seconds);
- verl (`compute_data_metrics`, actor and perf metrics): critic/score/mean,
  critic/advantages/mean, actor/entropy, actor/pg_clipfrac, actor/ppo_kl,
  actor/pg_loss, actor/lr, actor/grad_norm, response_length/mean,
  perf/throughput, perf/total_num_tokens, perf/max_memory_allocated_gb,
  timing_s/step (seconds);
- AReaL (`stats_tracker` under the `ppo_actor` scope, `/avg` of each
  statistic; the engine's grad_norm and lr as scalars): ppo_actor/task_reward/avg,
  ppo_actor/advantages/avg, ppo_actor/update/entropy/avg,
  ppo_actor/update/approx_kl/avg, ppo_actor/update/clip_ratio/avg,
  ppo_actor/update/actor_loss/avg, ppo_actor/update/grad_norm,
  ppo_actor/update/lr.

When a step has both the column's own name and an alias, the own name wins
and the alias stays in `metrics`. Every typed column (`TYPED_STEP_COLUMNS`) is
filled by its own name; the frameworks' names are listed here.
"""

from __future__ import annotations

import msgspec

from areal_metrics.producers.contract.events import TYPED_STEP_COLUMNS, StepEvent
from areal_metrics.producers.contract.field_rules import number_bounds

# column -> the frameworks' names for it, with the factor to the column's unit
FRAMEWORK_NAMES: dict[str, tuple[tuple[str, float], ...]] = {
    "reward": (("critic/score/mean", 1.0), ("ppo_actor/task_reward/avg", 1.0)),
    "entropy": (("actor/entropy", 1.0), ("ppo_actor/update/entropy/avg", 1.0)),
    "advantage_mean": (("critic/advantages/mean", 1.0), ("ppo_actor/advantages/avg", 1.0)),
    "kl": (("actor/ppo_kl", 1.0), ("ppo_actor/update/approx_kl/avg", 1.0)),
    "clip_ratio": (("clip_ratio/region_mean", 1.0), ("actor/pg_clipfrac", 1.0), ("ppo_actor/update/clip_ratio/avg", 1.0)),
    "loss": (("actor/pg_loss", 1.0), ("ppo_actor/update/actor_loss/avg", 1.0)),
    "lr": (("learning_rate", 1.0), ("actor/lr", 1.0), ("ppo_actor/update/lr", 1.0)),
    "grad_norm": (("actor/grad_norm", 1.0), ("ppo_actor/update/grad_norm", 1.0)),
    "response_length": (("completions/mean_length", 1.0), ("response_length/mean", 1.0)),
    "tokens": (("perf/total_num_tokens", 1.0),),
    "throughput": (("perf/throughput", 1.0),),
    "latency_ms": (("step_time", 1000.0), ("timing_s/step", 1000.0)),
    "gpu_mem_bytes": (("perf/max_memory_allocated_gb", float(1 << 30)),),
}

# column -> (name, factor to the column's unit), the column's own name first
COLUMN_ALIASES: dict[str, tuple[tuple[str, float], ...]] = {
    column: ((column, 1.0), *FRAMEWORK_NAMES.get(column, ())) for column in TYPED_STEP_COLUMNS
}

# name -> (column, factor, priority: 0 for the column's own name)
ALIASES: dict[str, tuple[str, float, int]] = {
    name: (column, factor, priority)
    for column, names in COLUMN_ALIASES.items()
    for priority, (name, factor) in enumerate(names)
}

_FIELD_TYPES = {f.name: next(t for t in f.type.types if not isinstance(t, msgspec.inspect.NoneType))
                for f in msgspec.inspect.type_info(StepEvent).fields  # type: ignore[union-attr]
                if f.name in TYPED_STEP_COLUMNS}

# Columns that hold integers: a float value is rounded when it is within this of an integer.
INT_COLUMNS = frozenset(c for c, t in _FIELD_TYPES.items() if isinstance(t, msgspec.inspect.IntType))


# Bounds of the typed columns, read from StepEvent's field types; a value a hair outside is clamped.
BOUNDS: dict[str, tuple[float, float]] = {
    column: bounds for column, bounds in number_bounds(StepEvent).items() if column in COLUMN_ALIASES}
