"""A step's reward over its ranks: the mean, once the step is complete or its wait is over.

Pure: `add_rank(state, report, now, cap)` and `expire(state, now, wait_s)` return the new
state and the steps that are ready (`StepReward`).

Rules (CONTRACT.md 'reward_smoothed')
- Every rank of a data-parallel trainer reports its own reward for a step. The step's
  reward is the mean over its ranks, weighted by `n_samples` when every rank that
  reported gave one (> 0), else unweighted. Never the first arrival alone.
- A step is ready when `world_size` distinct ranks reported (a report without
  `world_size` counts as a world of one: ready at once, as before world_size existed),
  or when `step_wait_s` have passed since its first report (then it is the mean of the
  ranks that came; `ranks < world_size` says so).
- A second report of the same rank for the same step (a redelivery, a retry) adds
  nothing. A report for a step already ready is the caller's to refuse (the smoothing
  window knows which steps were emitted).
- At most `cap` steps wait at once; beyond that the oldest is made ready as it is (a
  run whose ranks never all report must not grow the state without bound).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class RankReport:
    rank: int
    reward: float
    n_samples: int | None
    event_id: str
    ts: float


@dataclass(frozen=True, slots=True)
class PendingStep:
    step: int
    world_size: int
    opened_at: float  # worker clock at the first report: the wait counts from here
    reports: tuple[RankReport, ...] = ()


@dataclass(frozen=True, slots=True)
class RankState:
    pending: Mapping[int, PendingStep] = field(default_factory=dict)  # step -> its reports so far


@dataclass(frozen=True, slots=True)
class StepReward:
    """A step ready to be smoothed."""

    step: int
    reward: float
    ranks: int  # how many ranks it is the mean of
    world_size: int
    source_id: str  # event_id of the report that completed it ("" when its wait ran out)
    ts: float  # ts of the newest report


def mean_reward(reports: tuple[RankReport, ...]) -> float:
    weights = [r.n_samples for r in reports]
    if all(w is not None and w > 0 for w in weights):
        total = sum(weights)  # type: ignore[arg-type]
        return sum(r.reward * r.n_samples for r in reports) / total  # type: ignore[operator]
    return sum(r.reward for r in reports) / len(reports)


def _ready(p: PendingStep, source_id: str) -> StepReward:
    return StepReward(step=p.step, reward=mean_reward(p.reports), ranks=len(p.reports), world_size=p.world_size,
                      source_id=source_id, ts=max(r.ts for r in p.reports))


def add_rank(
    state: RankState, step: int, world_size: int | None, report: RankReport, now: float, cap: int = 256
) -> tuple[RankState, list[StepReward]]:
    world = max(1, world_size or 1)
    pending = state.pending.get(step) or PendingStep(step=step, world_size=world, opened_at=now)
    if any(r.rank == report.rank for r in pending.reports):
        return state, []
    pending = replace(pending, world_size=max(pending.world_size, world), reports=(*pending.reports, report))
    rest = {s: p for s, p in state.pending.items() if s != step}
    if len(pending.reports) >= pending.world_size:
        return RankState(rest), [_ready(pending, report.event_id)]
    rest[step] = pending
    ready: list[StepReward] = []
    while len(rest) > cap:
        oldest = min(rest.values(), key=lambda p: (p.opened_at, p.step))
        del rest[oldest.step]
        ready.append(_ready(oldest, ""))
    return RankState(rest), ready


def expire(state: RankState, now: float, wait_s: float) -> tuple[RankState, list[StepReward]]:
    """Steps that waited `wait_s` or longer for their ranks: ready with the ranks that came."""
    due = sorted((p for p in state.pending.values() if now - p.opened_at >= wait_s), key=lambda p: p.step)
    if not due:
        return state, []
    gone = {p.step for p in due}
    return RankState({s: p for s, p in state.pending.items() if s not in gone}), [_ready(p, "") for p in due]


def oldest_wait(state: RankState) -> float | None:
    """Worker clock of the oldest waiting step's first report (None: nothing waits)."""
    return min((p.opened_at for p in state.pending.values()), default=None)
