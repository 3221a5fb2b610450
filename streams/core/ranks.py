"""A step's reward over its ranks: the mean, once the step is complete or its wait is over.

Pure: `add_rank(state, key, world_size, report, now, cap)`, `expire(state, now, wait_s)` and
`supersede(state, attempt, from_step)` return the new state and the steps that are ready
(`StepReward`).

Rules (CONTRACT.md 'reward_smoothed')
- Every rank of a data-parallel trainer reports its own reward for a step. The step's
  reward is the mean over its ranks, weighted by `n_samples` when every rank with a
  reward gave one (and they sum to more than 0), else unweighted. Never the first
  arrival alone.
- A rank that reports the step without a reward (its reward was NaN/inf, so null)
  counts towards completion but not in the mean; a step no rank gave a reward for is
  ready with `reward None` (nothing to smooth).
- A step is ready when `world_size` distinct ranks reported (a report without
  `world_size` counts as a world of one: ready at once, as before world_size existed),
  or when `step_wait_s` have passed since its first report (then it is the mean of the
  ranks that came; `ranks < world_size` says so).
- Steps are keyed by (attempt, step): a resumed attempt's step 5 is not attempt 0's.
  `supersede` drops the waiting steps of earlier attempts that a new attempt replaces.
- A second report of the same rank for the same step (a redelivery, a retry) adds
  nothing. A report for a step already ready is the caller's to refuse (the smoothing
  window knows which steps were emitted).
- At most `cap` steps wait at once; beyond that the oldest (the step whose first report
  came first: the map keeps the steps in that order) is made ready as it is (a
  run whose ranks never all report must not grow the state without bound).

Cost: a step's tally is linear in its ranks. A waiting step's reports are a `Reports`, an
immutable sequence whose `has(rank)` is a dict lookup and whose `with_report` appends in
place to a buffer it shares with the sequence it came from (a persistent vector: the old
sequence still sees only its own length). Only adding to an older sequence, one that was
added to already (a state reused after a later one was made), copies its reports. With
a tuple, each report cost a scan and a copy of the reports before it: 1,024 ranks made
~500,000 comparisons and copies per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from operator import attrgetter
from typing import Any, overload

import msgspec
from msgspec.structs import force_setattr, replace

from areal_metrics.streams.core.stored import NO_PAIRS, Pairs, Stored, hold_pairs

StepKey = tuple[int, int]  # (attempt, step)
_OPENED_AT = attrgetter("opened_at")


class RankReport(Stored):
    rank: int
    reward: float | None
    n_samples: int | None


class Reports(Sequence[RankReport]):
    """A waiting step's reports in arrival order (immutable; the codec writes a JSON array of
    RankReports, as the tuple it replaces). `has(rank)` and `with_report(report)` cost O(1)."""

    __slots__ = ("buf", "at", "n")  # shared between the sequences of one buffer

    def __init__(self, reports: Iterable[RankReport] = ()) -> None:
        self.buf: list[RankReport] = list(reports)
        self.at: dict[int, int] = {}  # rank -> its first position in buf
        for i, r in enumerate(self.buf):
            self.at.setdefault(r.rank, i)
        self.n = len(self.buf)

    @classmethod
    def of_buffer(cls, buf: list[RankReport], at: dict[int, int], n: int) -> Reports:
        out = cls.__new__(cls)
        out.buf, out.at, out.n = buf, at, n
        return out

    def has(self, rank: int) -> bool:
        return self.at.get(rank, self.n) < self.n

    def with_report(self, report: RankReport) -> Reports:
        """These reports and `report` after them (the caller checked `has` first)."""
        if len(self.buf) == self.n:  # the newest sequence of its buffer: append in place
            buf, at = self.buf, self.at
        else:  # a later sequence already appended to the buffer: copy ours
            fresh = Reports(islice(self.buf, self.n))
            buf, at = fresh.buf, fresh.at
        buf.append(report)
        at.setdefault(report.rank, len(buf) - 1)
        return Reports.of_buffer(buf, at, len(buf))

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[RankReport]:
        return islice(self.buf, self.n)

    @overload
    def __getitem__(self, i: int) -> RankReport: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[RankReport, ...]: ...
    def __getitem__(self, i: Any) -> Any:
        return tuple(self)[i] if isinstance(i, slice) else self.buf[range(self.n)[i]]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Reports):
            return self.n == other.n and (self.buf is other.buf or tuple(self) == tuple(other))
        if isinstance(other, (tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Reports({tuple(self)!r})"


NO_REPORTS = Reports()


class PendingStep(Stored):
    world_size: int
    opened_at: float  # worker clock at the first report: the wait counts from here
    ts: float  # `ts` of the newest report (the smoothed event's ts: the same on a replay)
    reports: Reports = NO_REPORTS

    def __post_init__(self) -> None:
        if type(self.reports) is not Reports:  # a tuple or list given: held as Reports
            force_setattr(self, "reports", Reports(self.reports))


class RankState(Stored):
    pending: Pairs[StepKey, PendingStep] = NO_PAIRS  # (attempt, step) -> reports so far

    def __post_init__(self) -> None:
        hold_pairs(self, "pending")


# a frozen Struct: made per step, and its __init__ costs a tenth of a frozen dataclass's
class StepReward(msgspec.Struct, frozen=True, gc=False):
    """A step ready to be smoothed."""

    attempt: int
    step: int
    reward: float | None  # None: no rank had a reward for it
    ranks: int  # how many ranks reported it
    world_size: int
    source_id: str  # event_id of the report that completed it ("" when its wait ran out or it was evicted)
    ts: float


def mean_reward(reports: Sequence[RankReport]) -> float | None:
    rated = [r for r in reports if r.reward is not None]
    if not rated:
        return None
    weights = [r.n_samples for r in rated]
    if all(w is not None for w in weights) and sum(weights) > 0:  # type: ignore[arg-type]
        return sum(r.reward * r.n_samples for r in rated) / sum(weights)  # type: ignore[operator, arg-type]
    return sum(r.reward for r in rated) / len(rated)  # type: ignore[misc]


def _ready(key: StepKey, p: PendingStep, source_id: str) -> StepReward:
    return _ready_reports(key, p.world_size, p.reports, p.ts, source_id)


def _ready_reports(key: StepKey, world_size: int, reports: Sequence[RankReport], ts: float,
                   source_id: str) -> StepReward:
    return StepReward(key[0], key[1], mean_reward(reports), len(reports), world_size, source_id, ts)


def add_rank(
    state: RankState, key: StepKey, world_size: int | None, report: RankReport, ts: float, source_id: str,
    now: float, cap: int = 256,
) -> tuple[RankState, list[StepReward]]:
    world = max(1, world_size or 1)
    if world == 1 and key not in state.pending:  # a one-rank step is complete as it arrives: nothing waits
        return state, [_ready_reports(key, 1, (report,), ts, source_id)]
    pending = state.pending.get(key) or PendingStep(world_size=world, opened_at=now, ts=ts)
    if pending.reports.has(report.rank):
        return state, []
    pending = replace(pending, world_size=max(pending.world_size, world), ts=max(pending.ts, ts),
                      reports=pending.reports.with_report(report))
    rest = state.pending.copy()  # a C-level copy: a run can have hundreds of steps waiting
    if len(pending.reports) >= pending.world_size:
        rest.pop(key, None)
        return RankState(rest), [_ready(key, pending, source_id)]
    rest[key] = pending  # a new step joins the end, a waiting one keeps its place: first reported first
    ready: list[StepReward] = []
    while len(rest) > max(1, cap):
        oldest = next(iter(rest))  # the step reported first, waiting longest
        ready.append(_ready(oldest, rest.pop(oldest), ""))
    return RankState(rest), ready


def expire(state: RankState, now: float, wait_s: float) -> tuple[RankState, list[StepReward]]:
    """Steps that waited `wait_s` or longer for their ranks: ready with the ranks that came."""
    due = sorted(k for k, p in state.pending.items() if now - p.opened_at >= wait_s)
    if not due:
        return state, []
    ready = [_ready(k, state.pending[k], "") for k in due]
    return RankState({k: p for k, p in state.pending.items() if k not in set(due)}), ready


def supersede(state: RankState, attempt: int, from_step: int) -> RankState:
    """A step of `attempt` at `from_step` replaces earlier attempts' steps from there on:
    their waiting reports are dropped (they would count a replaced step)."""
    if not any(a < attempt and s >= from_step for a, s in state.pending):
        return state
    return RankState({k: p for k, p in state.pending.items() if not (k[0] < attempt and k[1] >= from_step)})


def oldest_wait(state: RankState) -> float | None:
    """Worker clock of the oldest waiting step's first report (None: nothing waits)."""
    return min(map(_OPENED_AT, state.pending.values()), default=None)
