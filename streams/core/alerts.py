"""Alert rules of one run, each a pure step function over a small frozen state.

- reward_below_threshold: the sliding average under `reward_threshold` (window full),
  armed once the average has been at or above it (a run that starts low is not a drop).
  Fires once per breach (an alert only: `scale_lr` comes from evaluation, see
  areal_metrics.streams.core.eval_loop); the breach ends when the average is back at threshold +
  reward_recover_margin; a new breach fires only when reward_cooldown_steps have passed
  since the last alert. Steps, not seconds, so a replay decides the same way.
- throughput_drop: a step's throughput under (1 - throughput_drop_ratio) x the median of
  the run's previous throughput_window values; once per drop, with a cooldown in steps.
- stalled: no step from a run for stall_seconds (clock injected: `now`); once until the
  run sends a step again; never for a run that has ended (areal_metrics.streams.core.lifecycle).
- non_finite: a step names fields whose NaN/inf became null (`non_finite`); one alert
  per run and field, in the step where the field first appears (a step with several new
  fields gives one alert naming them); at most NON_FINITE_FIELDS_KEPT fields remembered,
  then one last alert says no more will follow.
- invalid_event: a dead-lettered message; at most one alert per interval, the next one
  says how many were folded into it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from msgspec.structs import replace

from areal_metrics.producers.contract.events import ALERT_KINDS
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.stored import Stored
from areal_metrics.streams.core.smoothing import SmoothedPoint

NON_FINITE_FIELDS_KEPT = 64


@dataclass(frozen=True, slots=True)
class AlertDecision:
    """An alert, before it becomes an AlertEvent. `about` (the parts that name what it is
    about, kept apart: never one joined string) makes its id deterministic."""

    kind: str
    severity: str
    message: str
    about: tuple[Any, ...]
    step: int | None = None
    value: float | None = None
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ALERT_KINDS:  # the contract's list is what `alerts --kind` and users filter by
            raise ValueError(f"alert kind {self.kind!r} is not in the contract's ALERT_KINDS")


# ------------------------------------------------------------------ breach / cooldown


class BreachState(Stored):
    """Shared shape of a 'once per breach, with a cooldown' rule."""

    in_breach: bool = False
    last_fired_step: int | None = None
    armed: bool = True  # the reward rule arms itself once the reward has been above the threshold


def breach_step(state: BreachState, breached: bool, recovered: bool, step: int, cooldown: int) -> tuple[BreachState, bool]:
    """Advance a breach rule by one observation; True when an alert fires now."""
    if state.in_breach:
        return (replace(state, in_breach=False), False) if recovered else (state, False)
    if not breached:
        return state, False
    cooled = state.last_fired_step is None or step - state.last_fired_step >= cooldown
    if cooled:
        return replace(state, in_breach=True, last_fired_step=step), True
    return replace(state, in_breach=True), False


def check_reward(state: BreachState, point: SmoothedPoint, cfg: RunConfig) -> tuple[BreachState, list[AlertDecision]]:
    threshold = cfg.reward_threshold
    if threshold is None or point.window < cfg.window:
        return state, []
    avg = point.sliding_avg
    if not state.armed:
        # A run that starts below the threshold has not dropped below it: the rule arms
        # once the smoothed reward has reached threshold + margin.
        if avg >= threshold + cfg.reward_recover_margin:
            state = replace(state, armed=True)
        return state, []
    state, fired = breach_step(
        state, avg < threshold, avg >= threshold + cfg.reward_recover_margin, point.step, cfg.reward_cooldown_steps
    )
    if not fired:
        return state, []
    alert = AlertDecision(
        kind="reward_below_threshold",
        severity="critical",
        message=f"smoothed reward {avg:.4g} fell below {threshold:g} at step {point.step}",
        about=("reward_below_threshold", point.step),
        step=point.step,
        value=avg,
        threshold=threshold,
    )
    return state, [alert]


# ------------------------------------------------------------------ throughput


class ThroughputState(Stored):
    history: tuple[float, ...] = ()
    breach: BreachState = BreachState()


def check_throughput(
    state: ThroughputState, step: int, throughput: float, cfg: RunConfig
) -> tuple[ThroughputState, list[AlertDecision]]:
    alerts: list[AlertDecision] = []
    breach = state.breach
    if len(state.history) >= max(1, cfg.throughput_min_samples):
        median = statistics.median(state.history)
        limit = (1.0 - cfg.throughput_drop_ratio) * median
        breach, fired = breach_step(breach, throughput < limit, throughput >= limit, step, cfg.throughput_cooldown_steps)
        if fired:
            alerts.append(
                AlertDecision(
                    kind="throughput_drop",
                    severity="warning",
                    message=(
                        f"throughput {throughput:.4g} tokens/s at step {step} is under "
                        f"{1 - cfg.throughput_drop_ratio:.0%} of the run's trailing median {median:.4g}"
                    ),
                    about=("throughput_drop", step),
                    step=step,
                    value=throughput,
                    threshold=limit,
                )
            )
    history = (*state.history, throughput)[-max(1, cfg.throughput_window):]
    return ThroughputState(history, breach), alerts


# ------------------------------------------------------------------ stalled


class StallState(Stored):
    last_step_at: float | None = None  # worker clock when the run's last step arrived
    last_step: int | None = None
    stalled: bool = False
    last_attempt: int = 0  # the attempt of `last_step`


def is_newest(state: StallState, step: int, attempt: int) -> bool:
    """A step beyond every step seen, in (attempt, step) order: a resumed attempt's step 5
    comes after attempt 0's step 30."""
    return state.last_step is None or (attempt, step) > (state.last_attempt, state.last_step)


def saw_step(state: StallState, step: int, now: float, attempt: int = 0) -> StallState:
    if is_newest(state, step, attempt):
        return StallState(last_step_at=now, last_step=step, stalled=False, last_attempt=attempt)
    return replace(state, last_step_at=now, stalled=False)


def check_stalled(
    state: StallState, now: float, cfg: RunConfig, ended: bool = False
) -> tuple[StallState, list[AlertDecision]]:
    """`ended`: the run has ended (areal_metrics.streams.core.lifecycle): quiet, not stalled."""
    if ended or cfg.stall_seconds <= 0 or state.stalled or state.last_step_at is None:
        return state, []
    quiet = now - state.last_step_at
    if quiet < cfg.stall_seconds:
        return state, []
    alert = AlertDecision(
        kind="stalled",
        severity="critical",
        message=f"no step for {quiet:.0f} s (last step {state.last_step}; limit {cfg.stall_seconds:g} s)",
        # One alert per silence: the silence is named by the step it follows.
        about=("stalled", state.last_step, repr(state.last_step_at)),
        step=state.last_step,
        value=quiet,
        threshold=cfg.stall_seconds,
    )
    return replace(state, stalled=True), [alert]


# ------------------------------------------------------------------ abnormal end


def check_ended(before_ended: bool, ended: bool, status: str | None, attempt: int, rank: int,
                exit_code: int | None) -> list[AlertDecision]:
    """A run whose end the lifecycle just recorded as `failed` or `killed`: one alert.

    An ended run is no longer watched for `stalled` (areal_metrics.streams.core.lifecycle), so this is
    how a subscriber learns that a run died (a rank's exception, or the launcher
    tearing down the other ranks after one was lost); a finished run raises nothing.
    """
    if before_ended or not ended or status not in ("failed", "killed"):
        return []
    code = f", exit code {exit_code}" if exit_code is not None else ""
    return [AlertDecision(
        kind=f"run_{status}",
        severity="critical",
        message=f"the run ended {status} (attempt {attempt}, reported by rank {rank}{code})",
        about=("ended", attempt),
        value=float(exit_code) if exit_code is not None else None,
    )]


# ------------------------------------------------------------------ non-finite values


class NonFiniteState(Stored):
    fields: tuple[str, ...] = ()  # fields already alerted on, sorted
    saturated: bool = False  # NON_FINITE_FIELDS_KEPT reached: no more alerts


def check_non_finite(
    state: NonFiniteState, names: tuple[str, ...], step: int, rank: int
) -> tuple[NonFiniteState, list[AlertDecision]]:
    if state.saturated or not names:
        return state, []
    known = set(state.fields)
    new = sorted(set(names) - known)
    if not new:
        return state, []
    room = NON_FINITE_FIELDS_KEPT - len(known)
    taken, saturated = new[:room], len(new) > room
    shown = ", ".join(taken[:8]) + (f" and {len(taken) - 8} more" if len(taken) > 8 else "")
    tail = (f"; more than {NON_FINITE_FIELDS_KEPT} fields in this run, no further non_finite alerts"
            if saturated else "")
    alert = AlertDecision(
        kind="non_finite",
        severity="warning",
        message=(f"non-finite values (NaN/inf, stored as null) in {shown or 'more fields'} at step {step} "
                 f"(rank {rank}): the first in this run for these fields{tail}"),
        about=("non_finite", *(taken or ["saturated"])),
        step=step,
        value=float(len(new)),
    )
    return NonFiniteState(tuple(sorted(known | set(taken))), saturated), [alert]


# ------------------------------------------------------------------ invalid input


class InvalidState(Stored):
    last_alert_at: float | None = None
    folded: int = 0  # rejected since the last alert, not alerted on their own


def check_invalid(
    state: InvalidState, reason: str, source_topic: str, about: str, now: float, cfg: RunConfig
) -> tuple[InvalidState, list[AlertDecision]]:
    if state.last_alert_at is not None and now - state.last_alert_at < cfg.invalid_alert_interval_s:
        return replace(state, folded=state.folded + 1), []
    more = f" (+{state.folded} more since the last alert)" if state.folded else ""
    alert = AlertDecision(
        kind="invalid_event",
        severity="warning",
        message=f"dead-lettered input from {source_topic}: {reason}{more}",
        about=("invalid_event", about),
        value=float(state.folded + 1),
    )
    return InvalidState(last_alert_at=now, folded=0), [alert]
