"""Smoothed reward per run: a sliding window over the last W steps and an EMA.

Pure: `add_reward(state, step, reward, window, alpha, source_id, attempt) -> (state, outcome)`;
`classify` says what `add_reward` would do with a step, without doing it.

Rules
- One reward per step (areal_metrics.streams.core.ranks makes it the mean over the step's ranks first); a
  repeat (redelivery) is a duplicate and gets back the point that was emitted the first
  time, unchanged, so re-sending it after a crash is exact.
- Resume: the first step s of a later `attempt` replaces the earlier attempts' points from
  s on: they leave the window, and the EMA goes back to what it was before step s (from a
  trail of the EMA after each of the last EMA_TRAIL steps that left the window, counted from
  the farthest step the run reached; a resume further back starts the EMA over rather than
  count a replaced step twice). From then on a step of an earlier attempt at or after s is
  `stale` and ignored, so nothing counts twice and a resumed run's step 5 is not refused as
  a repeat.
- Steps may arrive out of order. The window holds the W highest distinct steps seen; a
  late step that still falls inside it is inserted in its place. A step older than the
  whole (full) window, or not after the last step that left it, is too late and ignored.
- The EMA runs over the distinct steps in step order: `ema_base` is the EMA of every step
  that has left the window, and the window's rewards are folded onto it. So, as long as
  steps are not later than the window, the result equals the EMA of the sorted sequence.
- `slope` is the least-squares slope of reward against step over the window: for a
  linear trend it is exactly the per-step change of the sliding average. `slope_se` is
  its standard error (the noise the adaptive trigger compares the slope with).
- The values emitted for a step describe the window right after that step joined it.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left
from functools import cache
from itertools import repeat
from typing import Literal

import msgspec
from msgspec.structs import replace

from areal_metrics.streams.core.stored import Stored

# EMA values kept for steps that left the window: a resume at most this far behind the farthest
# step the run reached is exact (a resume does not bring back entries a farther attempt pushed out)
EMA_TRAIL = 32
ATTEMPTS_KEPT = 32  # where the last attempts started (older boundaries are forgotten)


class SmoothedPoint(Stored):
    step: int
    reward: float
    window: int  # steps in the window when this point was emitted (<= W)
    sliding_avg: float
    ema: float
    slope: float
    source_id: str = ""  # event_id of the step event it came from: a redelivery of it is re-sent
    attempt: int = 0  # the run's attempt (resume) the step belongs to


class SmoothingState(Stored):
    points: tuple[SmoothedPoint, ...] = ()  # the window, sorted by step
    ema_base: float | None = None  # EMA over all steps older than the window
    max_step: int = -1
    attempt: int = 0  # the newest attempt seen
    starts: tuple[tuple[int, int], ...] = ()  # (attempt, its first step) of attempts > 0, by attempt
    ema_trail: tuple[tuple[int, float], ...] = ()  # (step, ema_base once it left the window), oldest first


Kind = Literal["new", "late", "duplicate", "too_late", "stale"]


# a frozen Struct: made per input, and its __init__ costs a tenth of a frozen dataclass's
class SmoothingOutcome(msgspec.Struct, frozen=True, gc=False):
    kind: Kind
    point: SmoothedPoint | None  # to emit (new/late), or the earlier one (duplicate); None when too late/stale
    slope_se: float = 0.0  # new/late: `slope_noise` of the window after the step joined it

    @property
    def is_newest(self) -> bool:
        """A new step beyond every step seen before: the one that moves decisions forward."""
        return self.kind == "new"


def ema_fold(base: float | None, rewards: list[float] | tuple[float, ...], alpha: float) -> float | None:
    ema = base
    for r in rewards:
        ema = r if ema is None else alpha * r + (1.0 - alpha) * ema
    return ema


def _dot(a: list[float], b: list[float]) -> float:
    return sum(map(operator.mul, a, b))  # math.sumprod from Python 3.12 on


def _sum_of_squares(a: list[float]) -> float:
    # x ** 2 is C's pow(), which can round differently from x * x: keep the first version's bits
    return sum(map(pow, a, repeat(2)))


def _fit(steps: list[int], values: list[float], with_se: bool) -> tuple[float, float]:
    """(least-squares slope, its standard error); one pass of each sum, so the two share them."""
    n = len(steps)
    if n < 2:
        return 0.0, 0.0
    mean_x = sum(steps) / n
    # map over C operators: the same float operations as the comprehensions, without a
    # Python-level loop (the worker fits the window once per step)
    dx = list(map(operator.sub, steps, repeat(mean_x)))
    sxx = _sum_of_squares(dx)
    if sxx == 0:
        return 0.0, 0.0
    return _fit_centred(dx, sxx, values, with_se)


def _fit_centred(dx: list[float], sxx: float, values: list[float], with_se: bool) -> tuple[float, float]:
    """`_fit` once the steps' deviations from their mean (`dx`, sxx > 0) are known."""
    n = len(dx)
    mean_y = sum(values) / n
    dy = [y - mean_y for y in values]
    slope = _dot(dx, dy) / sxx
    if not with_se or n < 3:
        return slope, 0.0
    # ** 2 as in _sum_of_squares (C's pow), in one pass with the residuals
    residual_ss = sum([(e - slope * d) ** 2 for e, d in zip(dy, dx)])
    return slope, math.sqrt(max(0.0, residual_ss) / (n - 2) / sxx)


@cache
def _centred_run(n: int) -> tuple[list[float], float]:
    """(dx, sxx) of n consecutive steps: x - mean_x is i - (n - 1) / 2 whatever the first step."""
    dx = [i - (n - 1) / 2 for i in range(n)]
    return dx, _sum_of_squares(dx)


def _window_fit(steps: list[int], values: list[float]) -> tuple[float, float]:
    """`_fit(steps, values, with_se=True)` of a window (distinct steps in order), the same bits.

    A window of consecutive steps (the usual case) takes dx and sxx from `_centred_run`: with
    steps below 2**50, sum(steps) / n = first + (n - 1) / 2 and each x - mean_x are exact in
    floating point, so they do not depend on the first step."""
    n = len(steps)
    if n < 3 or steps[-1] - steps[0] != n - 1 or steps[-1] >= 1 << 50:
        return _fit(steps, values, with_se=True)
    return _fit_centred(*_centred_run(n), values, with_se=True)


def ls_slope(steps: list[int], values: list[float]) -> float:
    return _fit(steps, values, with_se=False)[0]


def ls_slope_se(steps: list[int], values: list[float]) -> float:
    """Standard error of the least-squares slope (0 with fewer than 3 points: no estimate)."""
    return _fit(steps, values, with_se=True)[1]


def slope_noise(state: SmoothingState) -> float:
    """`ls_slope_se` over the current window."""
    return ls_slope_se([p.step for p in state.points], [p.reward for p in state.points])


def is_stale(state: SmoothingState, step: int, attempt: int) -> bool:
    """A step of an earlier attempt that a later attempt replaced (it started at or before it)."""
    return any(a > attempt and step >= first for a, first in state.starts)


def resume(state: SmoothingState, step: int, attempt: int) -> SmoothingState:
    """Record where `attempt` starts; its first step replaces earlier attempts' from there on."""
    if attempt > state.attempt:
        state = replace(state, attempt=attempt)
    if attempt == 0:
        return state
    first = dict(state.starts).get(attempt)
    if first is not None and first <= step:
        return state
    starts = tuple(sorted({**dict(state.starts), attempt: step}.items()))[-ATTEMPTS_KEPT:]
    state = replace(state, starts=starts)
    kept = tuple(p for p in state.points if not (p.attempt < attempt and p.step >= step))
    rewind = bool(state.ema_trail) and state.ema_trail[-1][0] >= step  # the EMA holds replaced steps
    if len(kept) == len(state.points) and not rewind:
        return state
    trail, base = state.ema_trail, state.ema_base
    if rewind:
        trail = tuple(t for t in trail if t[0] < step)
        base = trail[-1][1] if trail else None  # older than the trail: the EMA starts over
    max_step = max((p.step for p in kept), default=min(state.max_step, step - 1))
    return replace(state, points=kept, ema_base=base, ema_trail=trail, max_step=max_step)


def classify(state: SmoothingState, step: int, attempt: int, window: int) -> tuple[SmoothingState, SmoothingOutcome]:
    """What `add_reward` would make of this step: the state after the resume, and the kind
    (with the earlier point for a duplicate). Nothing is added."""
    if is_stale(state, step, attempt):
        return state, SmoothingOutcome("stale", None)
    state = resume(state, step, attempt)
    if step <= state.max_step:  # beyond every step seen it cannot be a repeat
        for p in state.points:
            if p.step == step:
                return state, SmoothingOutcome("duplicate", p)
    if (len(state.points) >= window and step < state.points[0].step) or (
        state.ema_trail and step <= state.ema_trail[-1][0]  # already in the EMA (a resume shrank the window)
    ):
        return state, SmoothingOutcome("too_late", None)
    return state, SmoothingOutcome("new" if step > state.max_step else "late", None)


def add_reward(
    state: SmoothingState, step: int, reward: float, window: int, alpha: float, source_id: str = "",
    attempt: int = 0,
) -> tuple[SmoothingState, SmoothingOutcome]:
    resumed, outcome = classify(state, step, attempt, window)
    if outcome.kind in ("stale", "duplicate", "too_late"):
        return (state if outcome.kind == "stale" else resumed), outcome
    state = resumed
    old = state.points
    if old and step < old[-1].step:  # a late step: inserted in step order (never the oldest of a full window)
        at = bisect_left([p.step for p in old], step)
    else:
        at = len(old)  # the usual case: the newest step
    steps = [p.step for p in old]
    rewards = [p.reward for p in old]
    steps.insert(at, step)
    rewards.insert(at, reward)
    out = max(0, len(steps) - window)  # the oldest leave the window
    ema_base, trail = state.ema_base, state.ema_trail
    for i in range(out):
        ema_base = ema_fold(ema_base, (rewards[i],), alpha)
        trail = (*trail, (steps[i], ema_base))[-EMA_TRAIL:]  # type: ignore[assignment]
    steps, rewards = steps[out:], rewards[out:]

    ema = ema_fold(ema_base, rewards, alpha)
    assert ema is not None
    slope, slope_se = _window_fit(steps, rewards)
    point = SmoothedPoint(step, reward, len(rewards), sum(rewards) / len(rewards), ema, slope, source_id, attempt)
    points = (*old[:at], point, *old[at:])[out:] if at >= out else old[out - 1:]  # (a shrunk window evicted it)
    new_state = replace(state, points=points, ema_base=ema_base, ema_trail=trail, max_step=max(state.max_step, step))
    return new_state, SmoothingOutcome(outcome.kind, point, slope_se)
