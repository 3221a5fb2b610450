"""Adaptive evaluation triggers: when to evaluate, decided from the smoothed reward.

Pure: `decide(state, point, cfg) -> (state, decisions)`, fed with the newest smoothed
point of a run (late and duplicate steps do not move decisions).

Policy (thresholds in areal_metrics.streams.core.config):
- The base interval is the one the trainer publishes: the `eval_interval_steps` key of
  its `run` event's config (also read: `eval_every_steps`, the name areal_train uses);
  until one arrives, or without one, `eval_interval` of the stream config.
- Nothing is decided before the window is full (the slope of 3 points is noise).
- A run has started learning once |slope| exceeded both `plateau_exit_slope` and
  `learning_slope_t` times its standard error (the slope stands out of the noise). Before
  that a flat reward is not a plateau: the mode stays normal (or fast).
- Mode from |slope| with hysteresis bands, so a slope hovering at a threshold does not
  flap: normal -> fast at |slope| >= fast_slope, fast -> normal only below
  fast_exit_slope; normal -> plateau at |slope| <= plateau_slope, plateau -> normal only
  above plateau_exit_slope.
- Only for runs that set `adaptive_interval` (run.config.eval_loop, else the worker's
  setting, default false): the mode and the interval below. Others get `evaluate_now` only.
- The interval follows the mode: fast halves it (not below min_eval_interval), plateau
  doubles it (not above max_eval_interval), normal returns to the base interval (the bounds
  widen to include a published base outside them). Neither the
  mode nor the interval changes within interval_dwell_steps of the last change (the
  slope of a noisy reward crosses any band now and then); each change is one
  `set_eval_interval` command.
- `evaluate_now` when the sliding average has moved by more than evaluate_delta since the
  baseline: the worker's last evaluate_now, else the first full window. The baseline moves only
  with the worker's own commands (the decisions depend on the step stream alone and replay
  identically), so the reason names what the baseline is ("since the evaluate_now sent at step
  N", "since step N, the first full window"), never an evaluation the worker did not see.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from msgspec.structs import replace

from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.stored import Stored
from areal_metrics.streams.core.smoothing import SmoothedPoint

Mode = Literal["normal", "fast", "plateau"]
Baseline = Literal["start", "request"]  # the first full window, the worker's last evaluate_now
# Config keys of the `run` event that give the trainer's evaluation interval (steps), in order.
INTERVAL_KEYS = ("eval_interval_steps", "eval_every_steps")


class TriggerState(Stored):
    mode: Mode = "normal"
    interval: int | None = None  # None: the run still uses cfg.eval_interval
    last_change_step: int | None = None
    baseline: float | None = None  # sliding average at the last evaluate_now (else the first full window)
    baseline_step: int | None = None
    baseline_from: Baseline = "start"  # what baseline_step names (an evaluate_now's reason says it truly)
    base_interval: int | None = None  # published by the trainer (run event); None: cfg.eval_interval
    learning: bool = False  # the slope once stood out of the noise (see module docstring)


@dataclass(frozen=True, slots=True)
class CommandDecision:
    """A command to a run's trainers, before it becomes a CommandEvent."""

    command: str
    args: dict[str, Any]
    reason: str
    step: int
    attempt: int = 0  # the run's attempt it was decided in (part of its event id when > 0)


def published_interval(config: Mapping[str, Any]) -> int | None:
    """The trainer's evaluation interval from its run config (None: absent or not a count >= 1)."""
    for key in INTERVAL_KEYS:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if value >= 1 and float(value).is_integer() and value <= 1 << 31:
            return int(value)
    return None


def with_base_interval(state: TriggerState, interval: int | None) -> TriggerState:
    return state if interval is None or interval == state.base_interval else replace(state, base_interval=interval)


def rewind(state: TriggerState, step: int) -> TriggerState:
    """A resumed attempt restarts at `step`: marks of later steps count from there (the
    dwell and the evaluate_now baseline would otherwise wait for the old step numbers)."""
    marks = {name: step for name in ("last_change_step", "baseline_step")
             if (getattr(state, name) or 0) > step}
    return replace(state, **marks) if marks else state


def _since(state: TriggerState) -> str:
    """What the baseline is, truly (the worker does not follow the run's evaluations here)."""
    if state.baseline_step is None:
        return "the start"
    if state.baseline_from == "request":
        return f"the evaluate_now sent at step {state.baseline_step}"
    return f"step {state.baseline_step} (the first full window)"


def next_mode(mode: Mode, abs_slope: float, cfg: RunConfig) -> Mode:
    if mode == "fast":
        if abs_slope >= cfg.fast_exit_slope:
            return "fast"
        return "plateau" if abs_slope <= cfg.plateau_slope else "normal"
    if mode == "plateau":
        if abs_slope <= cfg.plateau_exit_slope:
            return "plateau"
        return "fast" if abs_slope >= cfg.fast_slope else "normal"
    if abs_slope >= cfg.fast_slope:
        return "fast"
    if abs_slope <= cfg.plateau_slope:
        return "plateau"
    return "normal"


def target_interval(mode: Mode, interval: int, cfg: RunConfig, base: int | None = None) -> int:
    base = base or cfg.eval_interval
    if mode == "fast":
        return max(min(cfg.min_eval_interval, base), interval // 2)
    if mode == "plateau":
        return min(max(cfg.max_eval_interval, base), interval * 2)
    return base


def _mode_reason(mode: Mode, slope: float, cfg: RunConfig, slope_se: float) -> str:
    est = f"slope {slope:+.4g}/step, standard error {slope_se:.2g}"
    if mode == "fast":
        return f"reward moving fast ({est}, |slope| >= {cfg.fast_slope:g})"
    if mode == "plateau":
        return f"reward on a plateau ({est}, |slope| <= {cfg.plateau_slope:g})"
    return f"reward trend back to normal ({est})"


def decide(
    state: TriggerState, point: SmoothedPoint, cfg: RunConfig, slope_se: float = 0.0, adaptive: bool | None = None
) -> tuple[TriggerState, list[CommandDecision]]:
    """`slope_se`: the standard error of `point.slope` (areal_metrics.streams.core.smoothing.slope_noise);
    `adaptive`: whether the run takes `set_eval_interval` (None: cfg.adaptive_interval). A run
    that does not keeps its interval: only `evaluate_now` is decided for it."""
    if point.window < cfg.window:
        return state, []
    decisions: list[CommandDecision] = []
    slope = abs(point.slope)
    if not state.learning and slope > cfg.plateau_exit_slope and slope > cfg.learning_slope_t * slope_se:
        state = replace(state, learning=True)

    if state.baseline is None:
        state = replace(state, baseline=point.sliding_avg, baseline_step=point.step, baseline_from="start")
    elif abs(point.sliding_avg - state.baseline) > cfg.evaluate_delta:
        moved = point.sliding_avg - state.baseline
        decisions.append(
            CommandDecision(
                "evaluate_now",
                {},
                f"smoothed reward moved {moved:+.4g} since {_since(state)} "
                f"({state.baseline:.4g} -> {point.sliding_avg:.4g}; limit {cfg.evaluate_delta:g})",
                point.step,
                attempt=point.attempt,
            )
        )
        state = replace(state, baseline=point.sliding_avg, baseline_step=point.step, baseline_from="request")

    if not (cfg.adaptive_interval if adaptive is None else adaptive):
        return state, decisions
    base = state.base_interval or cfg.eval_interval
    interval = state.interval if state.interval is not None else base
    dwelt = state.last_change_step is None or point.step - state.last_change_step >= cfg.interval_dwell_steps
    mode = next_mode(state.mode, slope, cfg)
    if mode == "plateau" and not state.learning:
        mode = "normal"  # a run that has not started learning is flat, not on a plateau
    if not dwelt:
        mode = state.mode  # too soon after the last change: a noisy slope must not flap the interval
    entered = mode != state.mode
    new_interval = target_interval(mode, interval, cfg, base)
    if (entered or dwelt) and new_interval != interval:
        decisions.append(
            CommandDecision(
                "set_eval_interval",
                {"steps": new_interval},
                f"{_mode_reason(mode, point.slope, cfg, slope_se)}: evaluation interval {interval} -> {new_interval} steps",
                point.step,
                attempt=point.attempt,
            )
        )
        state = replace(state, interval=new_interval, last_change_step=point.step)
    if entered:
        state = replace(state, mode=mode)
    return state, decisions
