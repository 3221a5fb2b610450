"""Adaptive evaluation triggers: when to evaluate, decided from the smoothed reward.

Pure: `decide(state, point, cfg) -> (state, decisions)`, fed with the newest smoothed
point of a run (late and duplicate steps do not move decisions).

Policy (thresholds in streams.config):
- Nothing is decided before the window is full (the slope of 3 points is noise).
- Mode from |slope| with hysteresis bands, so a slope hovering at a threshold does not
  flap: normal -> fast at |slope| >= fast_slope, fast -> normal only below
  fast_exit_slope; normal -> plateau at |slope| <= plateau_slope, plateau -> normal only
  above plateau_exit_slope.
- The interval follows the mode: fast halves it (not below min_eval_interval), plateau
  doubles it (not above max_eval_interval), normal returns to eval_interval. Neither the
  mode nor the interval changes within interval_dwell_steps of the last change (the
  slope of a noisy reward crosses any band now and then); each change is one
  `set_eval_interval` command.
- `evaluate_now` when the sliding average has moved by more than evaluate_delta since the
  last evaluation the worker asked for (the first full window sets the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from streams.config import RunConfig
from streams.smoothing import SmoothedPoint

Mode = Literal["normal", "fast", "plateau"]


@dataclass(frozen=True, slots=True)
class TriggerState:
    mode: Mode = "normal"
    interval: int | None = None  # None: the run still uses cfg.eval_interval
    last_change_step: int | None = None
    baseline: float | None = None  # sliding average at the last evaluation asked for
    baseline_step: int | None = None


@dataclass(frozen=True, slots=True)
class CommandDecision:
    """A command to a run's trainers, before it becomes a CommandEvent."""

    command: str
    args: dict[str, Any]
    reason: str
    step: int


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


def target_interval(mode: Mode, interval: int, cfg: RunConfig) -> int:
    if mode == "fast":
        return max(cfg.min_eval_interval, interval // 2)
    if mode == "plateau":
        return min(cfg.max_eval_interval, interval * 2)
    return cfg.eval_interval


def _mode_reason(mode: Mode, slope: float, cfg: RunConfig) -> str:
    if mode == "fast":
        return f"reward moving fast (slope {slope:+.4g}/step, |slope| >= {cfg.fast_slope:g})"
    if mode == "plateau":
        return f"reward on a plateau (slope {slope:+.4g}/step, |slope| <= {cfg.plateau_slope:g})"
    return f"reward trend back to normal (slope {slope:+.4g}/step)"


def decide(state: TriggerState, point: SmoothedPoint, cfg: RunConfig) -> tuple[TriggerState, list[CommandDecision]]:
    if point.window < cfg.window:
        return state, []
    decisions: list[CommandDecision] = []

    if state.baseline is None:
        state = replace(state, baseline=point.sliding_avg, baseline_step=point.step)
    elif abs(point.sliding_avg - state.baseline) > cfg.evaluate_delta:
        moved = point.sliding_avg - state.baseline
        since = f"step {state.baseline_step}" if state.baseline_step is not None else "the start"
        decisions.append(
            CommandDecision(
                "evaluate_now",
                {},
                f"smoothed reward moved {moved:+.4g} since the last evaluation at {since} "
                f"({state.baseline:.4g} -> {point.sliding_avg:.4g}; limit {cfg.evaluate_delta:g})",
                point.step,
            )
        )
        state = replace(state, baseline=point.sliding_avg, baseline_step=point.step)

    interval = state.interval if state.interval is not None else cfg.eval_interval
    dwelt = state.last_change_step is None or point.step - state.last_change_step >= cfg.interval_dwell_steps
    mode = next_mode(state.mode, abs(point.slope), cfg)
    if not dwelt:
        mode = state.mode  # too soon after the last change: a noisy slope must not flap the interval
    entered = mode != state.mode
    new_interval = target_interval(mode, interval, cfg)
    if (entered or dwelt) and new_interval != interval:
        decisions.append(
            CommandDecision(
                "set_eval_interval",
                {"steps": new_interval},
                f"{_mode_reason(mode, point.slope, cfg)}: evaluation interval {interval} -> {new_interval} steps",
                point.step,
            )
        )
        state = replace(state, interval=new_interval, last_change_step=point.step)
    if entered:
        state = replace(state, mode=mode)
    return state, decisions
