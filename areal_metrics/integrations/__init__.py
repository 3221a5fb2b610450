"""Framework integrations: small adapters from a framework's logging hook to `areal_metrics.init`.

Each module is imported on demand (`import areal_metrics` never imports this
package) and touches its framework only when it is itself imported or used:

- `areal_metrics.integrations.trl`: a `transformers.TrainerCallback` for TRL's
  trainers (and any HF `Trainer`), which also obeys `evaluate_now`, `stop` and
  `set_eval_interval` from the control topic;
- `areal_metrics.integrations.areal`: tees what AReaL's `StatsLogger` commits;
- `areal_metrics.integrations.verl`: a backend for verl's `Tracking`.

Copy-paste snippets and what each was tested against: docs/INTEGRATIONS.md.
"""
