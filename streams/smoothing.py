"""Smoothed reward per run: a sliding window over the last W steps and an EMA.

Pure: `add_reward(state, step, reward, window, alpha) -> (state, outcome)`.

Rules
- One reward per step (streams.ranks makes it the mean over the step's ranks first); a
  repeat (redelivery) is a duplicate and gets back the point that was emitted the first
  time, unchanged, so re-sending it after a crash is exact.
- Resume: a step of a later `attempt` replaces the earlier attempts' points from that
  step on (they leave the window; the EMA of steps that already left it stays), so a
  resumed run's step 5 is not refused as a repeat and nothing counts twice.
- Steps may arrive out of order. The window holds the W highest distinct steps seen; a
  late step that still falls inside it is inserted in its place. A step older than the
  whole (full) window is too late and ignored.
- The EMA runs over the distinct steps in step order: `ema_base` is the EMA of every step
  that has left the window, and the window's rewards are folded onto it. So, as long as
  steps are not later than the window, the result equals the EMA of the sorted sequence.
- `slope` is the least-squares slope of reward against step over the window: for a
  linear trend it is exactly the per-step change of the sliding average.
- The values emitted for a step describe the window right after that step joined it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class SmoothedPoint:
    step: int
    reward: float
    window: int  # steps in the window when this point was emitted (<= W)
    sliding_avg: float
    ema: float
    slope: float
    source_id: str = ""  # event_id of the step event it came from: a redelivery of it is re-sent
    attempt: int = 0  # the run's attempt (resume) the step belongs to


@dataclass(frozen=True, slots=True)
class SmoothingState:
    points: tuple[SmoothedPoint, ...] = ()  # the window, sorted by step
    ema_base: float | None = None  # EMA over all steps older than the window
    max_step: int = -1


Kind = Literal["new", "late", "duplicate", "too_late"]


@dataclass(frozen=True, slots=True)
class SmoothingOutcome:
    kind: Kind
    point: SmoothedPoint | None  # to emit (new/late), or the earlier one (duplicate); None when too late

    @property
    def is_newest(self) -> bool:
        """A new step beyond every step seen before: the one that moves decisions forward."""
        return self.kind == "new"


def ema_fold(base: float | None, rewards: list[float] | tuple[float, ...], alpha: float) -> float | None:
    ema = base
    for r in rewards:
        ema = r if ema is None else alpha * r + (1.0 - alpha) * ema
    return ema


def ls_slope(steps: list[int], values: list[float]) -> float:
    n = len(steps)
    if n < 2:
        return 0.0
    mean_x = sum(steps) / n
    mean_y = sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in steps)
    if sxx == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, values)) / sxx


def resume_from(state: SmoothingState, step: int, attempt: int) -> SmoothingState:
    """A later attempt (a resumed run) replaces the earlier attempts' steps from `step` on."""
    if not any(p.attempt < attempt and p.step >= step for p in state.points):
        return state
    kept = tuple(p for p in state.points if not (p.attempt < attempt and p.step >= step))
    return SmoothingState(kept, state.ema_base, max((p.step for p in kept), default=step - 1))


def add_reward(
    state: SmoothingState, step: int, reward: float, window: int, alpha: float, source_id: str = "",
    attempt: int = 0,
) -> tuple[SmoothingState, SmoothingOutcome]:
    state = resume_from(state, step, attempt)
    for p in state.points:
        if p.step == step:
            return state, SmoothingOutcome("duplicate", p)
    if step <= state.max_step and (
        len(state.points) >= window and state.points and step < state.points[0].step
    ):
        return state, SmoothingOutcome("too_late", None)

    kind: Kind = "new" if step > state.max_step else "late"
    # Insert in step order; the placeholder gets its values below.
    placeholder = SmoothedPoint(step, reward, 0, 0.0, 0.0, 0.0, source_id, attempt)
    points = sorted((*state.points, placeholder), key=lambda p: p.step)
    ema_base = state.ema_base
    while len(points) > window:
        evicted = points.pop(0)
        ema_base = ema_fold(ema_base, [evicted.reward], alpha)

    rewards = [p.reward for p in points]
    steps = [p.step for p in points]
    ema = ema_fold(ema_base, rewards, alpha)
    assert ema is not None
    point = SmoothedPoint(
        step=step,
        reward=reward,
        window=len(points),
        sliding_avg=sum(rewards) / len(rewards),
        ema=ema,
        slope=ls_slope(steps, rewards),
        source_id=source_id,
        attempt=attempt,
    )
    points = [point if p is placeholder else p for p in points]
    new_state = SmoothingState(points=tuple(points), ema_base=ema_base, max_step=max(state.max_step, step))
    return new_state, SmoothingOutcome(kind, point)
