"""Thresholds and knobs of the stream worker, with per-run overrides.

Defaults (every one can be overridden for all runs or for one run):

Smoothing
  window = 20                  steps in the sliding average (the last W distinct steps)
  ema_alpha = 0.1              EMA weight of the newest step
  step_wait_s = 30.0           a step waits this long (worker clock) for all `world_size` ranks;
                               then it is the mean of the ranks that came
  max_pending_steps = 256      steps waiting for ranks per run; beyond, the oldest goes as it is
Adaptive evaluation triggers
  eval_interval = 25           the interval (steps) a run starts with and returns to in normal mode,
                               when its run event does not publish one (`eval_interval_steps`)
  min_eval_interval = 10       never shorter than this
  max_eval_interval = 200      never longer than this
  fast_slope = 0.01            |slope| (reward per step) at which the reward "moves fast" ...
  fast_exit_slope = 0.005      ... and below which it stops moving fast (hysteresis)
  plateau_slope = 0.001        |slope| at or below which the reward is on a plateau ...
  plateau_exit_slope = 0.002   ... and above which it leaves the plateau (hysteresis)
  interval_dwell_steps = 50    at least this many steps between two interval (or mode) changes
  learning_slope_t = 3.0       a run has started learning once |slope| > this x its standard error
                               (and > plateau_exit_slope); before, no plateau
  evaluate_delta = 0.1         ask for `evaluate_now` when the smoothed reward moved more than
                               this since the last evaluation the worker asked for
Closed loop on evaluation (areal_metrics.streams.core.eval_loop: non-stale consensus of one stage)
A run's `run.config.eval_loop` overrides these for that run (EVAL_LOOP_KEYS: the contract's names).
  eval_loop_enabled = True     the loop may send `scale_lr` (also needs lr_eval_threshold)
  lr_eval_threshold = None     `scale_lr` by lr_factor when the interval says the accuracy is below it
                               (None: off)
  lr_eval_dataset = None       the dataset watched (None: the run's first dataset of that stage)
  lr_eval_stage = "full"       the stage watched
  lr_alpha = 0.05              the false-alarm rate the run's decisions keep over all its rounds
  lr_factor = 0.5              the `factor` of a lowering `scale_lr`, in (0, 1)
  lr_min_factor = 0.125        floor of the cumulative factor
  lr_rollback = False          a threshold drop's `scale_lr` also names `restore_step`: the latest round
                               whose 95 % interval lay at or above the threshold (the trainer
                               restores the weights it had then)
  lr_restore_margin = 0.0      a breach ends when the 95 % interval's low end is >= threshold + margin ...
  lr_restore_factor = 2.0      ... and a raise (after lr_raise_after_rounds) scales lr back up by this,
                               capped below the rate at which accuracy dropped (and at 1.0)
  lr_apply_delay_steps = 5     `from_step` = the evaluated step + this
  lr_horizon_rounds = 200      the rounds over which the run's decisions keep their false-alarm rate
                               lr_alpha (a run's `eval_loop.horizon_rounds`; else, when its run event
                               publishes `total_steps` and `eval_interval_steps`, their ratio)
  lr_raise_after_rounds = 3    after a threshold cut, the lr is raised again only after this many
                               rounds at the lower rate, none read below the threshold
  no_improvement_rounds = 5    patience: every this many rounds, a test whether improvement stopped;
                               `no_improvement` (+ `scale_lr` when the loop is on) when it did (0: off)
  lr_improve_delta = 0.01      improvement per round below which it counts as stopped
  adaptive_interval = False    the adaptive trigger sends `set_eval_interval` (only to runs that set it)
Alerts
  reward_threshold = None      `reward_below_threshold` when the sliding average drops below it,
                               once it has been above it (None: off)
  reward_recover_margin = 0.0  the breach ends when the average is back >= threshold + margin
  reward_cooldown_steps = 50   a new breach within this many steps of the last alert stays quiet
  throughput_window = 50       trailing values the throughput median is taken over
  throughput_min_samples = 10  no throughput alert before this many values
  throughput_drop_ratio = 0.5  alert when throughput < (1 - ratio) * trailing median
  throughput_cooldown_steps = 50
  stall_seconds = 300.0        `stalled` when a run sends no step for this long (0: off)
  invalid_alert_interval_s = 60.0  at most one `invalid_event` alert per run and topic per interval
Cross-node vote
  vote_timeout_s = 120.0       a round still open this long after its first result closes
                               (partial consensus with a quorum, else failed)
  vote_tolerance = 0.02        values (accuracy) within this distance agree
  divergence_threshold = 0.05  `node_divergence` when a node's share of samples off the consensus
                               (or its accuracy's distance from it) exceeds this
  vote_undecided_alert = 0.05  `vote_undecided` when a round's share of undecided samples exceeds
                               this (default from AREAL_VOTE_UNDECIDED_ALERT)
Commands acknowledged (areal_metrics.streams.core.acks)
  command_ack_steps = 10       `command_not_applied` when a node publishes a step this many steps past
                               a `scale_lr`'s from_step without acknowledging it (AREAL_COMMAND_ACK_STEPS
                               sets the default)

The file named by AREAL_STREAMS_CONFIG (JSON) may change them:

    {"defaults": {"window": 10, "reward_threshold": 0.2},
     "runs": {"ppo-7b-*": {"reward_threshold": 0.3}, "ppo-7b-a": {"stall_seconds": 60}}}

`runs` keys are run ids or shell-style patterns; matching entries apply in file order, so a
later, more specific entry wins. Unknown names are refused with a message naming them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_metrics.producers.contract.config_fields import typed_fields
from areal_metrics.producers.contract.errors import ConfigError

CONFIG_ENV = "AREAL_STREAMS_CONFIG"
_OPTIONAL = frozenset({"reward_threshold", "lr_eval_threshold", "lr_eval_dataset"})  # None: off / any
_TEXT = frozenset({"lr_eval_dataset", "lr_eval_stage"})  # names, not numbers
_FLAGS = frozenset({"eval_loop_enabled", "adaptive_interval", "lr_rollback"})  # true / false
# `run.config.eval_loop` key (CONTRACT.md, "Evaluation you can trust") -> the RunConfig field it sets.
EVAL_LOOP_KEYS = {
    "enabled": "eval_loop_enabled",
    "dataset": "lr_eval_dataset",
    "stage": "lr_eval_stage",
    "threshold": "lr_eval_threshold",
    "alpha": "lr_alpha",
    "patience_rounds": "no_improvement_rounds",
    "factor": "lr_factor",
    "min_factor": "lr_min_factor",
    "adaptive_interval": "adaptive_interval",
    "rollback": "lr_rollback",
    "horizon_rounds": "lr_horizon_rounds",
    "raise_after_rounds": "lr_raise_after_rounds",
}


@dataclass(frozen=True, slots=True)
class RunConfig:
    window: int = 20
    ema_alpha: float = 0.1
    step_wait_s: float = 30.0
    max_pending_steps: int = 256
    eval_interval: int = 25
    min_eval_interval: int = 10
    max_eval_interval: int = 200
    fast_slope: float = 0.01
    fast_exit_slope: float = 0.005
    plateau_slope: float = 0.001
    plateau_exit_slope: float = 0.002
    interval_dwell_steps: int = 50
    learning_slope_t: float = 3.0
    evaluate_delta: float = 0.1
    reward_threshold: float | None = None
    reward_recover_margin: float = 0.0
    reward_cooldown_steps: int = 50
    lr_factor: float = 0.5
    eval_loop_enabled: bool = True
    lr_eval_threshold: float | None = None
    lr_eval_dataset: str | None = None
    lr_eval_stage: str = "full"
    lr_alpha: float = 0.05
    adaptive_interval: bool = False
    lr_min_factor: float = 0.125
    lr_rollback: bool = False
    lr_restore_margin: float = 0.0
    lr_restore_factor: float = 2.0
    lr_apply_delay_steps: int = 5
    lr_horizon_rounds: int = 200
    lr_raise_after_rounds: int = 3
    no_improvement_rounds: int = 5
    lr_improve_delta: float = 0.01
    throughput_window: int = 50
    throughput_min_samples: int = 10
    throughput_drop_ratio: float = 0.5
    throughput_cooldown_steps: int = 50
    stall_seconds: float = 300.0
    invalid_alert_interval_s: float = 60.0
    vote_timeout_s: float = 120.0
    vote_tolerance: float = 0.02
    divergence_threshold: float = 0.05
    command_ack_steps: int = 10
    vote_undecided_alert: float = 0.05

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name in _OPTIONAL:
                continue
            if f.name in _FLAGS:
                if not isinstance(value, bool):
                    raise ConfigError(f"streams config {f.name}: must be true or false ({value!r})")
                continue
            if f.name in _TEXT:
                if not isinstance(value, str) or not 1 <= len(value) <= 128:
                    raise ConfigError(f"streams config {f.name}: must be a name of 1..128 characters ({value!r})")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"streams config {f.name}: not a number ({value!r})")
            if f.type == "int" and not isinstance(value, int):
                raise ConfigError(f"streams config {f.name}: not an integer ({value!r})")
            try:
                finite = math.isfinite(value)
            except OverflowError:  # an integer too large for a float
                finite = False
            if not finite:
                raise ConfigError(f"streams config {f.name}: not finite or too large ({str(value)[:40]})")
        if self.window < 1:
            raise ConfigError(f"streams config window: must be >= 1 (got {self.window})")
        if not 0 < self.ema_alpha <= 1:
            raise ConfigError(f"streams config ema_alpha: must be in (0, 1] (got {self.ema_alpha})")
        if not 1 <= self.min_eval_interval <= self.eval_interval <= self.max_eval_interval:
            raise ConfigError(
                "streams config eval_interval: need 1 <= min_eval_interval <= eval_interval <= max_eval_interval"
            )
        if not self.fast_exit_slope <= self.fast_slope:
            raise ConfigError("streams config fast_exit_slope: must be <= fast_slope (hysteresis)")
        if not self.plateau_slope <= self.plateau_exit_slope <= self.fast_exit_slope:
            raise ConfigError(
                "streams config plateau_exit_slope: need plateau_slope <= plateau_exit_slope <= fast_exit_slope"
            )
        self._check_eval_loop()
        if not 0 < self.throughput_drop_ratio < 1:
            raise ConfigError("streams config throughput_drop_ratio: must be in (0, 1)")
        if self.max_pending_steps < 1:
            raise ConfigError(f"streams config max_pending_steps: must be >= 1 (got {self.max_pending_steps})")
        for name in ("interval_dwell_steps", "reward_cooldown_steps", "throughput_cooldown_steps", "command_ack_steps",
                     "throughput_window", "throughput_min_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"streams config {name}: must be >= 0")
        if not 0 <= self.vote_undecided_alert <= 1:
            raise ConfigError(f"streams config vote_undecided_alert: must be a share in [0, 1] "
                              f"(got {self.vote_undecided_alert})")
        for name in ("stall_seconds", "invalid_alert_interval_s", "vote_timeout_s", "vote_tolerance",
                     "divergence_threshold", "evaluate_delta", "reward_recover_margin", "step_wait_s",
                     "learning_slope_t"):
            if getattr(self, name) < 0:
                raise ConfigError(f"streams config {name}: must be >= 0")

    def _check_eval_loop(self) -> None:
        if not 0 < self.lr_factor < 1:
            raise ConfigError(f"streams config lr_factor: must be in (0, 1) (got {self.lr_factor})")
        # 0.01: a restore of the whole way back (1 / floor) must stay a valid factor (<= 100).
        if not 0.01 <= self.lr_min_factor <= 1:
            raise ConfigError(f"streams config lr_min_factor: must be in [0.01, 1] (got {self.lr_min_factor})")
        if not 1 < self.lr_restore_factor <= 100:
            raise ConfigError(f"streams config lr_restore_factor: must be in (1, 100] (got {self.lr_restore_factor})")
        if self.lr_eval_stage not in ("quick", "full"):
            raise ConfigError(f"streams config lr_eval_stage: must be quick or full (got {self.lr_eval_stage!r})")
        if not 0 < self.lr_alpha <= 0.5:
            raise ConfigError(f"streams config lr_alpha: must be in (0, 0.5] (got {self.lr_alpha})")
        if self.lr_eval_threshold is not None and not 0 <= self.lr_eval_threshold <= 1:
            raise ConfigError(f"streams config lr_eval_threshold: must be an accuracy in [0, 1] "
                              f"(got {self.lr_eval_threshold})")
        if not 1 <= self.lr_horizon_rounds <= 1_000_000:
            raise ConfigError(f"streams config lr_horizon_rounds: must be in [1, 1000000] "
                              f"(got {self.lr_horizon_rounds})")
        for name in ("lr_restore_margin", "lr_apply_delay_steps", "no_improvement_rounds", "lr_improve_delta",
                     "lr_raise_after_rounds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"streams config {name}: must be >= 0")

    def with_overrides(self, overrides: Mapping[str, Any], where: str = "") -> RunConfig:
        return dataclasses.replace(self, **typed_fields(RunConfig, overrides, f"streams config{where}"))


def eval_loop_overrides(raw: Any, cfg: RunConfig) -> tuple[dict[str, Any], list[str]]:
    """A run's `run.config.eval_loop` -> (RunConfig overrides that are valid on `cfg`, one
    error per refused key, naming it). A refused key keeps the worker's setting."""
    if raw is None:
        return {}, []
    if not isinstance(raw, Mapping):
        return {}, [f"run.config.eval_loop: not an object ({type(raw).__name__})"]
    good: dict[str, Any] = {}
    errors = []
    for key, value in raw.items():
        name = EVAL_LOOP_KEYS.get(key)
        if name is None:
            errors.append(f"run.config.eval_loop.{str(key)[:64]}: unknown (known: {', '.join(EVAL_LOOP_KEYS)})")
            continue
        try:
            cfg.with_overrides({**good, name: value})
        except ConfigError as exc:
            errors.append(f"run.config.eval_loop.{key}: {str(exc).rpartition(': ')[2] or exc}"[:300])
            continue
        good[name] = value
    return good, errors


# Knobs whose default an environment variable may set (AREAL_<NAME>); a config file's value wins.
ENV_DEFAULTS = ("command_ack_steps", "vote_undecided_alert")


@dataclass(frozen=True, slots=True)
class StreamsConfig:
    """Defaults for every run plus per-run (or per-pattern) overrides."""

    defaults: RunConfig = field(default_factory=RunConfig)
    runs: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    # How often the worker checks clocks (stalled runs, vote timeouts), seconds.
    tick_interval_s: float = 1.0

    def for_run(self, run_id: str) -> RunConfig:
        cfg = self.defaults
        for pattern, overrides in self.runs:
            if pattern == run_id or fnmatch.fnmatchcase(run_id, pattern):
                cfg = cfg.with_overrides(overrides, f" runs.{pattern}")
        return cfg

    @classmethod
    def from_dict(cls, data: Any) -> StreamsConfig:
        if not isinstance(data, dict):
            raise ConfigError("streams config: not a JSON object")
        unknown = sorted(set(data) - {"defaults", "runs", "tick_interval_s"})
        if unknown:
            raise ConfigError(f"streams config: unknown key {', '.join(map(repr, unknown))}")
        defaults = data.get("defaults", {})
        runs = data.get("runs", {})
        if not isinstance(defaults, dict):
            raise ConfigError("streams config defaults: not an object")
        if not isinstance(runs, dict):
            raise ConfigError("streams config runs: not an object")
        base = RunConfig().with_overrides(defaults, " defaults")
        pairs: list[tuple[str, Mapping[str, Any]]] = []
        for pattern, overrides in runs.items():
            if not isinstance(overrides, dict):
                raise ConfigError(f"streams config runs.{pattern!r}: not an object")
            base.with_overrides(overrides, f" runs.{pattern!r}")  # validate now, not at the first step
            pairs.append((pattern, dict(overrides)))
        tick = data.get("tick_interval_s", 1.0)
        if isinstance(tick, bool) or not isinstance(tick, (int, float)) or not 0 < tick <= 3600:
            raise ConfigError(f"streams config tick_interval_s: must be a number in (0, 3600] (got {tick!r})")
        return cls(defaults=base, runs=tuple(pairs), tick_interval_s=float(tick))

    @classmethod
    def load(cls, path: str | Path | None = None, env: Mapping[str, Any] | None = None) -> StreamsConfig:
        """The config from `path`, else the defaults; `env`: the knobs of ENV_DEFAULTS the environment set
        (under the file's values). The entry point reads both (`areal_metrics.streams.__main__.load_config`)."""
        env = dict(env or {})
        if not path:
            return cls(defaults=RunConfig().with_overrides(env))
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"streams config {path}: cannot read ({exc.strerror})") from None
        except ValueError as exc:
            raise ConfigError(f"streams config {path}: not valid JSON ({exc})") from None
        if env and isinstance(data, dict) and isinstance(data.get("defaults", {}), dict):
            data = {**data, "defaults": {**env, **data.get("defaults", {})}}  # the file's value wins
        return cls.from_dict(data)
