"""A step's reward is the mean over its ranks (areal_metrics.streams.core.ranks), through the run processor too."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.streams.state import codec
from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.processor import RunState, on_step, on_tick
from areal_metrics.streams.core.ranks import RankReport, RankState, add_rank, expire, mean_reward, oldest_wait, supersede

CFG = RunConfig(window=3, step_wait_s=10.0)


def step_ev(step: int, rank: int, reward: float | None, *, world: int | None = 2, attempt: int = 0,
            n_samples: int | None = None, event_id: str | None = None) -> StepEvent:
    return StepEvent(run_id="run-r", node=f"n{rank}", rank=rank, step=step, epoch=0, reward=reward,
                     world_size=world, attempt=attempt, n_samples=n_samples, ts=1000.0 + step + rank / 10,
                     event_id=event_id or f"a{attempt}-s{step}-r{rank}")


def smoothed(outputs) -> list:
    return [o.event for o in outputs if o.event.type == "reward_smoothed"]


# ------------------------------------------------------------------ the pure core


def test_mean_is_weighted_by_n_samples_only_when_every_rank_gave_one() -> None:
    assert mean_reward((RankReport(0, 0.0, 1), RankReport(1, 1.0, 3))) == 0.75
    assert mean_reward((RankReport(0, 0.0, 1), RankReport(1, 1.0, None))) == 0.5
    assert mean_reward((RankReport(0, 0.0, 0), RankReport(1, 1.0, 0))) == 0.5  # no weight at all: plain mean
    assert mean_reward((RankReport(0, 0.2, 0), RankReport(1, 1.0, 4))) == 1.0  # a rank with no samples weighs 0
    assert mean_reward((RankReport(0, None, 5), RankReport(1, 0.4, 1))) == 0.4  # its reward was NaN -> null
    assert mean_reward((RankReport(0, None, None),)) is None


def test_a_step_is_ready_when_its_world_reported_and_a_repeat_adds_nothing() -> None:
    state, ready = add_rank(RankState(), (0, 7), 2, RankReport(0, 0.0, None), 1.0, "e0", now=5.0)
    assert ready == [] and list(state.pending) == [(0, 7)]
    same, ready = add_rank(state, (0, 7), 2, RankReport(0, 9.0, None), 1.0, "e0-again", now=6.0)
    assert ready == [] and same == state
    state, ready = add_rank(state, (0, 7), 2, RankReport(1, 1.0, None), 2.0, "e1", now=7.0)
    assert state.pending == {}
    assert [(r.step, r.reward, r.ranks, r.source_id, r.ts) for r in ready] == [(7, 0.5, 2, "e1", 2.0)]


def test_a_step_whose_ranks_do_not_all_come_is_ready_at_its_wait() -> None:
    state, _ = add_rank(RankState(), (0, 1), 3, RankReport(0, 0.3, None), 1.0, "e0", now=100.0)
    state, _ = add_rank(state, (0, 2), 3, RankReport(0, 0.6, None), 2.0, "e1", now=104.0)
    assert oldest_wait(state) == 100.0
    assert expire(state, 109.9, 10.0) == (state, [])
    state, ready = expire(state, 110.0, 10.0)
    assert [(r.step, r.reward, r.ranks, r.world_size, r.source_id) for r in ready] == [(1, 0.3, 1, 3, "")]
    assert list(state.pending) == [(0, 2)]


def test_waiting_steps_are_bounded() -> None:
    state = RankState()
    evicted = []
    for step in range(10):
        state, ready = add_rank(state, (0, step), 2, RankReport(0, float(step), None), 1.0, f"e{step}",
                                now=float(step), cap=4)
        evicted += [r.step for r in ready]
    assert len(state.pending) == 4 and evicted == [0, 1, 2, 3, 4, 5]


def test_a_new_attempt_supersedes_the_waiting_steps_it_replaces() -> None:
    state = RankState()
    for key in ((0, 4), (0, 5), (0, 6), (1, 6)):
        state, _ = add_rank(state, key, 2, RankReport(0, 1.0, None), 1.0, "e", now=1.0)
    assert sorted(supersede(state, 1, 5).pending) == [(0, 4), (1, 6)]
    assert supersede(state, 0, 0) is state


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.integers(0, 50)), min_size=1, max_size=8), st.randoms(), st.booleans())
def test_the_mean_does_not_depend_on_the_order_ranks_arrive_in(ranks, rnd: random.Random, weighted: bool) -> None:
    reports = [RankReport(i, r, n if weighted else None) for i, (r, n) in enumerate(ranks)]
    order = list(reports)
    rnd.shuffle(order)
    state, got = RankState(), []
    for i, rep in enumerate(order):
        state, ready = add_rank(state, (0, 3), len(reports), rep, float(i), f"e{rep.rank}", now=float(i))
        got += ready
        if i < len(order) - 1:
            assert ready == []
    assert len(got) == 1 and state.pending == {}
    total = sum(r.n_samples for r in reports) if weighted else 0  # type: ignore[misc]
    if weighted and total > 0:
        expected = sum(r.reward * r.n_samples for r in reports) / total  # type: ignore[operator]
    else:
        expected = sum(r.reward for r in reports) / len(reports)  # type: ignore[misc]
    assert abs(got[0].reward - expected) < 1e-9  # type: ignore[operator]


# ------------------------------------------------------------------ through the run processor


def test_two_ranks_with_different_rewards_are_smoothed_as_their_mean() -> None:
    """The issue-11 case: rank 0 at 0.0 and rank 1 at 1.0 must read 0.5, not 0.0."""
    state, out = on_step(RunState("run-r"), step_ev(0, 0, 0.0), 1.0, CFG)
    assert smoothed(out) == []  # rank 1 still to come: the first arrival alone is never the reward
    state, out = on_step(state, step_ev(0, 1, 1.0), 1.5, CFG)
    [point] = smoothed(out)
    assert (point.step, point.reward, point.sliding_avg, point.ema) == (0, 0.5, 0.5, 0.5)
    assert point.ts == step_ev(0, 1, 1.0).ts  # the newest report's ts: the same on a replay
    state, out = on_step(state, step_ev(1, 1, 0.8, n_samples=3), 2.0, CFG)
    state, out = on_step(state, step_ev(1, 0, 0.0, n_samples=1), 2.5, CFG)
    [point] = smoothed(out)
    # (0.8*3 + 0*1) / 4, then (0.5 + 0.6) / 2
    assert point.reward == pytest.approx(0.6) and point.sliding_avg == pytest.approx(0.55)
    assert state.ranks.pending == {}
    assert codec.loads(RunState, codec.dumps(state)) == state


def test_a_missing_rank_is_waited_for_then_the_tick_emits_the_mean_of_those_that_came() -> None:
    state, _ = on_step(RunState("run-r"), step_ev(0, 0, 0.2, world=3), 100.0, CFG)
    state, _ = on_step(state, step_ev(0, 2, 0.4, world=3), 101.0, CFG)
    state, out = on_tick(state, 109.0, CFG)
    assert smoothed(out) == []
    state, out = on_tick(state, 110.0, CFG)
    [point] = smoothed(out)
    assert abs(point.reward - 0.3) < 1e-12
    assert all(o.must_ack for o in out)  # no input to redeliver it: delivered before the state is saved
    _, late = on_step(state, step_ev(0, 1, 5.0, world=3), 111.0, CFG)  # the straggler changes nothing
    assert late == []


def test_a_redelivered_completing_report_resends_its_point_and_other_ranks_add_nothing() -> None:
    state, _ = on_step(RunState("run-r"), step_ev(0, 0, 0.0), 1.0, CFG)
    state, first = on_step(state, step_ev(0, 1, 1.0), 2.0, CFG)
    assert [o.must_ack for o in first] == [False]  # the completing event re-sends it when redelivered
    same, again = on_step(state, step_ev(0, 1, 1.0), 3.0, CFG)
    assert [o.event.to_dict() for o in again] == [first[0].event.to_dict()]
    assert (same.smoothing, same.ranks) == (state.smoothing, state.ranks)
    _, other = on_step(state, step_ev(0, 0, 0.0), 3.0, CFG)
    assert other == []


def test_a_rank_whose_reward_was_not_finite_still_completes_the_step() -> None:
    state, _ = on_step(RunState("run-r"), step_ev(0, 0, 0.7), 1.0, CFG)
    nan_rank = StepEvent(run_id="run-r", node="n1", rank=1, step=0, epoch=0, reward=None, world_size=2,
                         non_finite=("reward",), ts=1000.0, event_id="nan")
    state, out = on_step(state, nan_rank, 1.1, CFG)
    assert [p.reward for p in smoothed(out)] == [0.7]
    assert [(o.event.kind, o.event.step) for o in out if o.event.type == "alert"] == [("non_finite", 0)]


def test_steps_without_world_size_count_at_once_as_before() -> None:
    state, out = on_step(RunState("run-r"), step_ev(0, 0, 0.25, world=None), 1.0, CFG)
    assert [p.reward for p in smoothed(out)] == [0.25] and state.ranks.pending == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 3), st.integers(0, 2)), max_size=60),
       st.integers(1, 5))
def test_the_step_evicted_is_the_one_reported_first(reports, cap) -> None:
    """Beyond `cap` waiting steps the oldest goes out: the one whose first report came first,
    whatever the clock says (it repeats within a batch and may step back) and whatever
    reports came for the others since."""
    state = RankState()
    waiting: dict[tuple[int, int], set[int]] = {}  # the model: waiting steps in first-report order
    for i, (step, rank, tick) in enumerate(reports):
        now = float(i // 4 + tick)
        key = (step % 2, step)
        state, ready = add_rank(state, key, 4, RankReport(rank, 1.0, None), 1.0, f"e{i}", now=now, cap=cap)
        expected = []
        if rank not in waiting.get(key, set()):
            waiting.setdefault(key, set()).add(rank)
            if len(waiting[key]) == 4:  # complete: it leaves, nothing is evicted
                del waiting[key]
            while len(waiting) > cap:
                oldest = next(iter(waiting))
                expected.append(oldest)
                del waiting[oldest]
        assert [(r.attempt, r.step) for r in ready if r.source_id == ""] == expected
        assert list(state.pending) == list(waiting)
        assert [len(p.reports) for p in state.pending.values()] == [len(r) for r in waiting.values()]


def test_a_run_logged_from_rank_zero_alone_stops_waiting_once_its_one_registered_rank_is_trusted() -> None:
    """Issue 40, item 12: RANK=0 WORLD_SIZE=2, and rank 1 never logs. Until the count of registered
    ranks has held for step_wait_s a step waits for rank 1 (its `running` could be on its way); after
    that, rank 0's step is complete as it arrives. A second registered rank is waited for again."""
    from areal_metrics.producers.contract.events import RunEvent
    from areal_metrics.streams.core.processor import on_run

    def running(rank: int) -> RunEvent:
        return RunEvent(run_id="r", node=f"h{rank}", rank=rank, status="running", world_size=2, ts=0.0,
                        event_id=f"run-{rank}")

    state, _ = on_run(RunState("r"), running(0), 0.0, CFG)
    state, out = on_step(state, step_ev(1, 0, 0.5), 1.0, CFG)
    assert smoothed(out) == [] and state.ranks.pending  # 1 s after the only `running`: rank 1 may still come
    state, out = on_step(state, step_ev(2, 0, 0.6), 11.0, CFG)
    assert [p.step for p in smoothed(out)] == [2] and list(state.ranks.pending) == [(0, 1)]
    state, _ = on_run(state, running(1), 12.0, CFG)
    state, out = on_step(state, step_ev(3, 0, 0.7), 30.0, CFG)
    assert smoothed(out) == []  # two registered ranks: rank 1 is waited for
    state, out = on_step(state, step_ev(3, 1, 0.9), 31.0, CFG)
    assert [p.step for p in smoothed(out)] == [3]


# ---------------------------------------------------------------- the tally's cost: linear in ranks

def _old_add_rank(pending: dict, key, world_size, report: RankReport, ts: float, source_id: str, now: float,
                  cap: int) -> tuple[dict, list[tuple]]:
    """The rule as it was written before `Reports` (a scan and a tuple copy per report), over
    plain dicts and tuples: the reference the linear tally must agree with."""
    world = max(1, world_size or 1)

    def ready(k, w, reports, t, src):
        return (k[0], k[1], mean_reward(reports), len(reports), w, src, t)

    if world == 1 and key not in pending:
        return pending, [ready(key, 1, (report,), ts, source_id)]
    w, opened, t, reports = pending.get(key) or (world, now, ts, ())
    if report.rank in [r.rank for r in reports]:
        return pending, []
    w, t, reports = max(w, world), max(t, ts), (*reports, report)
    rest = dict(pending)
    if len(reports) >= w:
        rest.pop(key, None)
        return rest, [ready(key, w, reports, t, source_id)]
    rest[key] = (w, opened, t, reports)
    out = []
    while len(rest) > max(1, cap):
        oldest = next(iter(rest))
        ow, _, ot, orep = rest.pop(oldest)
        out.append(ready(oldest, ow, orep, ot, ""))
    return rest, out


def _plain(state: RankState) -> dict:
    return {k: (p.world_size, p.opened_at, p.ts, tuple(p.reports)) for k, p in state.pending.items()}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3), st.integers(0, 3), st.integers(0, 7),
                          st.one_of(st.none(), st.floats(-2, 2)), st.one_of(st.none(), st.integers(0, 9)),
                          st.integers(0, 10)), max_size=80),
       st.integers(1, 4))
def test_the_linear_tally_gives_what_the_old_rule_gave(ops, cap) -> None:
    """Any reports, duplicates and worlds included, added to any earlier state (a state used
    again after a later one was made takes the copying path): the same waiting steps, reports
    and ready steps as the old rule, and the state survives the codec."""
    history: list[tuple[RankState, dict]] = [(RankState(), {})]
    for i, (back, step, world, rank, reward, n, now) in enumerate(ops):
        state, model = history[max(0, len(history) - 1 - back)]
        report = RankReport(rank, reward, n)
        key = (step % 2, step)
        state, ready = add_rank(state, key, world, report, float(i), f"e{i}", now=float(now), cap=cap)
        model, expected = _old_add_rank(model, key, world, report, float(i), f"e{i}", float(now), cap)
        assert [(r.attempt, r.step, r.reward, r.ranks, r.world_size, r.source_id, r.ts) for r in ready] == expected
        assert _plain(state) == model
        assert codec.loads(RankState, codec.dumps(state)) == state
        history.append((state, model))
    for state, model in history:  # appending in place never changed what an earlier state holds
        assert _plain(state) == model


def test_1024_ranks_are_tallied_in_place_and_give_the_weighted_mean() -> None:
    np = pytest.importorskip("numpy")
    rnd = random.Random(1024)
    rewards = [rnd.uniform(-1, 1) for _ in range(1024)]
    samples = [rnd.randint(1, 64) for _ in range(1024)]
    order = list(range(1024)) + rnd.sample(range(1024), 200)  # every rank, then 200 redeliveries
    rnd.shuffle(order)
    state, got, seen = RankState(), [], set()
    for i, rank in enumerate(order):
        before = state.pending.get((0, 9))
        state, ready = add_rank(state, (0, 9), 1024, RankReport(rank, rewards[rank], samples[rank]), float(i),
                                f"e{i}", now=0.0)
        got += ready
        after = state.pending.get((0, 9))
        if before is not None and after is not None and rank not in seen:
            # the report went onto the buffer the step already had: no copy of the reports before it
            assert after.reports.buf is before.reports.buf and len(after.reports) == len(before.reports) + 1
        if before is not None and rank in seen:
            assert ready == [] and after is before  # a redelivery adds nothing
        seen.add(rank)
    assert len(got) == 1 and state.pending == {}
    assert got[0].ranks == 1024 and got[0].world_size == 1024
    assert got[0].reward == pytest.approx(float(np.average(rewards, weights=samples)), rel=1e-12)
