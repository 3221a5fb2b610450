"""Thresholds and knobs of the stream worker, with per-run overrides.

`RunConfig` declares each knob once: its type (the annotation), its range (`Meta`), its default
and its text (`Meta(description=...)`); docs/STREAMS.md's table is printed from it
(`python -m areal_metrics.streams.core.config`, held to it by tests/test_streams_policy.py).
Every path that makes one checks it (`areal_metrics.producers.contract.config_fields`): code,
the config file, a run's `run.config.eval_loop`; rules between knobs are `RunConfig.cross_check`.

The file named by AREAL_STREAMS_CONFIG (JSON) may change them:

    {"defaults": {"window": 10, "reward_threshold": 0.2},
     "runs": {"ppo-7b-*": {"reward_threshold": 0.3}, "ppo-7b-a": {"stall_seconds": 60}}}

`runs` keys are run ids or shell-style patterns; matching entries apply in file order, so a
later, more specific entry wins. Unknown names are refused with a message naming them.
A run's `run.config.eval_loop` overrides the knobs that name an `eval_loop` key for that run
(EVAL_LOOP_KEYS: the contract's names, CONTRACT.md "Evaluation you can trust").
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from msgspec import Meta

from areal_metrics.producers.contract.config_fields import Config, knobs, load, replaced
from areal_metrics.producers.contract.errors import ConfigError

CONFIG_ENV = "AREAL_STREAMS_CONFIG"


def _k(description: str, *, section: str | None = None, eval_loop: str | None = None, env: str | None = None,
       **bounds: Any) -> Meta:
    """A knob's Meta: its range, its text, and where else it is set (a run's eval_loop key, a variable)."""
    extra = {k: v for k, v in (("section", section), ("eval_loop", eval_loop), ("env", env)) if v is not None}
    return Meta(description=description, extra=extra or None, **bounds)


class RunConfig(Config, frozen=True):
    # Smoothing
    window: Annotated[int, _k("steps in the sliding average (the last W distinct steps)", section="Smoothing",
                              ge=1)] = 20
    ema_alpha: Annotated[float, _k("EMA weight of the newest step", gt=0, le=1)] = 0.1
    step_wait_s: Annotated[float, _k("a step waits this long (worker clock) for all `world_size` ranks; then it is "
                                     "the mean of the ranks that came", ge=0)] = 30.0
    max_pending_steps: Annotated[int, _k("steps waiting for ranks per run; beyond, the oldest goes as it is",
                                         ge=1)] = 256
    # Adaptive evaluation triggers
    eval_interval: Annotated[int, _k("the interval (steps) a run starts with and returns to in normal mode, when "
                                     "its run event does not publish one (`eval_interval_steps`); "
                                     "min_eval_interval <= it <= max_eval_interval",
                                     section="Adaptive evaluation triggers", ge=1)] = 25
    min_eval_interval: Annotated[int, _k("never shorter than this", ge=1)] = 10
    max_eval_interval: Annotated[int, _k("never longer than this", ge=1)] = 200
    fast_slope: Annotated[float, _k("|slope| (reward per step) at which the reward \"moves fast\" ...")] = 0.01
    fast_exit_slope: Annotated[float, _k("... and below which it stops moving fast (hysteresis; <= fast_slope)")] \
        = 0.005
    plateau_slope: Annotated[float, _k("|slope| at or below which the reward is on a plateau ...")] = 0.001
    plateau_exit_slope: Annotated[float, _k("... and above which it leaves the plateau (hysteresis; "
                                            "plateau_slope <= it <= fast_exit_slope)")] = 0.002
    interval_dwell_steps: Annotated[int, _k("at least this many steps between two interval (or mode) changes",
                                            ge=0)] = 50
    learning_slope_t: Annotated[float, _k("a run has started learning once |slope| > this x its standard error "
                                          "(and > plateau_exit_slope); before, no plateau", ge=0)] = 3.0
    evaluate_delta: Annotated[float, _k("ask for `evaluate_now` when the smoothed reward moved more than this "
                                        "since the last evaluation the worker asked for", ge=0)] = 0.1
    adaptive_interval: Annotated[bool, _k("the adaptive trigger sends `set_eval_interval` (only to runs that set "
                                          "it)", eval_loop="adaptive_interval")] = False
    # Closed loop on evaluation (eval_loop.py: non-stale consensus of one stage)
    eval_loop_enabled: Annotated[bool, _k("the loop may send `scale_lr` (also needs lr_eval_threshold)",
                                          section="Closed loop on evaluation (`streams/core/eval_loop.py`)",
                                          eval_loop="enabled")] = True
    lr_eval_threshold: Annotated[float, _k("`scale_lr` by lr_factor when the interval says the accuracy is below "
                                           "it (null: off)", eval_loop="threshold", ge=0, le=1)] | None = None
    lr_eval_dataset: Annotated[str, _k("the dataset watched (null: the run's first dataset of that stage)",
                                       eval_loop="dataset", min_length=1, max_length=128)] | None = None
    lr_eval_stage: Annotated[Literal["quick", "full"], _k("the stage watched", eval_loop="stage")] = "full"
    lr_alpha: Annotated[float, _k("the false-alarm rate the run's decisions keep over all its rounds",
                                  eval_loop="alpha", gt=0, le=0.5)] = 0.05
    lr_factor: Annotated[float, _k("the `factor` of a lowering `scale_lr`", eval_loop="factor", gt=0, lt=1)] = 0.5
    # 0.01: a restore of the whole way back (1 / floor) must stay a valid factor (<= 100).
    lr_min_factor: Annotated[float, _k("floor of the cumulative factor", eval_loop="min_factor",
                                       ge=0.01, le=1)] = 0.125
    lr_rollback: Annotated[bool, _k("a threshold drop's `scale_lr` also names `restore_step`: the latest round "
                                    "whose 95 % interval lay at or above the threshold (the trainer restores the "
                                    "weights it had then)", eval_loop="rollback")] = False
    lr_restore_margin: Annotated[float, _k("a breach ends when the 95 % interval's low end is >= threshold + "
                                           "margin ...", ge=0)] = 0.0
    lr_restore_factor: Annotated[float, _k("... and a raise (after lr_raise_after_rounds) scales lr back up by "
                                           "this, capped below the rate at which accuracy dropped (and at 1.0)",
                                           gt=1, le=100)] = 2.0
    lr_apply_delay_steps: Annotated[int, _k("`from_step` = the evaluated step + this", ge=0)] = 5
    lr_horizon_rounds: Annotated[int, _k("the rounds over which the run's decisions keep their false-alarm rate "
                                         "lr_alpha (else, when its run event publishes `total_steps` and "
                                         "`eval_interval_steps`, their ratio)", eval_loop="horizon_rounds",
                                         ge=1, le=1_000_000)] = 200
    lr_raise_after_rounds: Annotated[int, _k("after a threshold cut, the lr is raised again only after this many "
                                             "rounds at the lower rate, none read below the threshold",
                                             eval_loop="raise_after_rounds", ge=0)] = 3
    no_improvement_rounds: Annotated[int, _k("patience: every this many rounds, a test whether improvement "
                                             "stopped; `no_improvement` (+ `scale_lr` when the loop is on) when "
                                             "it did (0: off)", eval_loop="patience_rounds", ge=0)] = 5
    lr_improve_delta: Annotated[float, _k("improvement per round below which it counts as stopped", ge=0)] = 0.01
    # Alerts
    reward_threshold: Annotated[float | None, _k("`reward_below_threshold` when the sliding average drops below "
                                                 "it, once it has been above it (null: off)",
                                                 section="Alerts")] = None
    reward_recover_margin: Annotated[float, _k("the breach ends when the average is back >= threshold + margin",
                                               ge=0)] = 0.0
    reward_cooldown_steps: Annotated[int, _k("a new breach within this many steps of the last alert stays quiet",
                                             ge=0)] = 50
    throughput_window: Annotated[int, _k("trailing values the throughput median is taken over", ge=0)] = 50
    throughput_min_samples: Annotated[int, _k("no throughput alert before this many values", ge=0)] = 10
    throughput_drop_ratio: Annotated[float, _k("alert when throughput < (1 - ratio) x trailing median",
                                               gt=0, lt=1)] = 0.5
    throughput_cooldown_steps: Annotated[int, _k("a new throughput drop within this many steps of the last alert "
                                                 "stays quiet", ge=0)] = 50
    stall_seconds: Annotated[float, _k("`stalled` when a run sends no step for this long (0: off)", ge=0)] = 300.0
    invalid_alert_interval_s: Annotated[float, _k("at most one `invalid_event` alert per run and topic per "
                                                  "interval", ge=0)] = 60.0
    # Cross-node vote
    vote_timeout_s: Annotated[float, _k("a round still open this long after its first result closes (partial "
                                        "consensus with a quorum, else failed)", section="Cross-node vote",
                                        ge=0)] = 120.0
    vote_tolerance: Annotated[float, _k("values (accuracy) within this distance agree", ge=0)] = 0.02
    divergence_threshold: Annotated[float, _k("`node_divergence` when a node's share of samples off the consensus "
                                              "(or its accuracy's distance from it) exceeds this", ge=0)] = 0.05
    vote_undecided_alert: Annotated[float, _k("`vote_undecided` when a round's share of undecided samples exceeds "
                                              "this", env="AREAL_VOTE_UNDECIDED_ALERT", ge=0, le=1)] = 0.05
    # Commands acknowledged (acks.py)
    command_ack_steps: Annotated[int, _k("`command_not_applied` when a node publishes a step this many steps past "
                                         "a `scale_lr`'s from_step without acknowledging it",
                                         section="Commands acknowledged (`streams/core/acks.py`)",
                                         env="AREAL_COMMAND_ACK_STEPS", ge=0)] = 10

    def cross_check(self) -> None:
        if not self.min_eval_interval <= self.eval_interval <= self.max_eval_interval:
            raise ConfigError("eval_interval: need 1 <= min_eval_interval <= eval_interval <= max_eval_interval")
        if not self.fast_exit_slope <= self.fast_slope:
            raise ConfigError("fast_exit_slope: must be <= fast_slope (hysteresis)")
        if not self.plateau_slope <= self.plateau_exit_slope <= self.fast_exit_slope:
            raise ConfigError("plateau_exit_slope: need plateau_slope <= plateau_exit_slope <= fast_exit_slope")

    def with_overrides(self, overrides: Mapping[str, Any], where: str = "") -> RunConfig:
        """This config with `overrides` (untrusted: from a file or a run event) applied and checked."""
        return replaced(self, overrides, f"streams config{where}")


# `run.config.eval_loop` key (CONTRACT.md, "Evaluation you can trust") -> the RunConfig field it sets.
EVAL_LOOP_KEYS = {k.extra["eval_loop"]: k.name for k in knobs(RunConfig) if "eval_loop" in k.extra}
# Knobs whose default an environment variable may set (AREAL_<NAME>, declared in settings.py); a config
# file's value wins.
ENV_DEFAULTS = tuple(k.name for k in knobs(RunConfig) if "env" in k.extra)


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


class StreamsFile(Config, frozen=True):
    """The shape of the AREAL_STREAMS_CONFIG file."""

    defaults: dict[str, Any] = {}  # RunConfig knobs for every run
    runs: dict[str, dict[str, Any]] = {}  # run id or pattern -> RunConfig knobs
    tick_interval_s: Annotated[float, Meta(description="how often the worker checks clocks (stalled runs, vote "
                                                       "timeouts), seconds", gt=0, le=3600)] = 1.0


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
        file = load(StreamsFile, data, "streams config")
        base = RunConfig().with_overrides(file.defaults, " defaults")
        for pattern, overrides in file.runs.items():
            base.with_overrides(overrides, f" runs.{pattern!r}")  # validate now, not at the first step
        return cls(defaults=base, runs=tuple(file.runs.items()), tick_interval_s=file.tick_interval_s)

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


def markdown_table() -> str:
    """docs/STREAMS.md's table of knobs, from the declarations (RunConfig, then the file's own)."""
    rows = ["| knob | default | allowed | what |", "|---|---|---|---|"]
    for cls, first in ((RunConfig, None), (StreamsFile, "The file's top level")):
        for k in knobs(cls):
            if not k.description:
                continue
            section = k.extra.get("section", first if cls is StreamsFile else None)
            if section:
                rows.append(f"| **{section}** | | | |")
                first = None
            what = k.description
            if "eval_loop" in k.extra:
                what += f"; a run's `eval_loop.{k.extra['eval_loop']}`"
            if "env" in k.extra:
                what += f"; `{k.extra['env']}` sets the default"
            cell = what.replace("|", "\\|")
            rows.append(f"| `{k.name}` | {json.dumps(k.default)} | {k.rule or 'any'} | {cell} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
