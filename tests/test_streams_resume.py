"""A resumed run (a later `attempt` restarting at an earlier step): nothing counts twice."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import StepEvent
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.processor import RunState, derived_id, on_step
from areal_metrics.streams.core.smoothing import EMA_TRAIL, SmoothingState, add_reward, classify, ema_fold


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def test_a_later_attempt_replaces_the_earlier_steps_from_where_it_starts() -> None:
    state = SmoothingState()
    for step in range(10):
        state, _ = add_reward(state, step, 0.0, 4, 0.5, f"a0-{step}", attempt=0)
    state, out = add_reward(state, 8, 1.0, 4, 0.5, "a1-8", attempt=1)
    assert out.kind == "new"  # not a repeat of attempt 0's step 8
    assert [(p.step, p.attempt) for p in state.points] == [(6, 0), (7, 0), (8, 1)]
    assert out.point is not None and out.point.sliding_avg == 1 / 3
    # attempt 0's step 9 arrives late (a redelivery): replaced, so stale
    after, late = add_reward(state, 9, 5.0, 4, 0.5, "a0-9", attempt=0)
    assert late.kind == "stale" and after == state
    # attempt 0's step 7 is still the step 7 of the run: a redelivery of it is a duplicate
    assert classify(state, 7, 0, 4)[1].kind == "duplicate"


def test_the_ema_goes_back_to_before_the_resumed_step() -> None:
    rewards0 = [float(i % 3) for i in range(30)]
    state = SmoothingState()
    for step, r in enumerate(rewards0):
        state, _ = add_reward(state, step, r, 5, 0.3, attempt=0)
    for step in range(12, 20):  # resumed from a checkpoint at step 12, well behind the window (25..29)
        state, out = add_reward(state, step, 10.0, 5, 0.3, attempt=1)
    effective = rewards0[:12] + [10.0] * 8
    assert out.point is not None and close(out.point.ema, ema_fold(None, effective, 0.3))  # type: ignore[arg-type]
    assert [p.step for p in state.points] == list(range(15, 20))


def test_a_resume_farther_back_than_the_trail_reaches_starts_the_ema_over() -> None:
    # The property test below found it in a full-suite run (window 1): steps 0..33, a resume at 3,
    # then one at 1. Step 0's EMA left the trail while the run was at step 33, so the EMA restarts
    # at step 1.
    state = SmoothingState()
    for attempt, start, rewards in ((0, 0, [0.0] * 27), (1, 26, [0.0] * 8), (2, 3, [0.0]), (3, 1, [1.0])):
        for i, r in enumerate(rewards):
            state, out = add_reward(state, start + i, r, 1, 0.5, attempt=attempt)
    assert out.point is not None and out.point.ema == 1.0  # not 0.5, the EMA of steps 0 and 1
    assert [p.step for p in state.points] == [1] and state.ema_base is None


@st.composite
def attempts(draw) -> tuple[list[tuple[int, int, list[float]]], int]:
    """Attempts as (attempt, first step, rewards); each resumes at most EMA_TRAIL - 1 steps behind
    the farthest step the run reached (the trail's reach: a resume does not bring back what a
    replaced, farther attempt pushed out of it), and not beyond where the last attempt ended."""
    window = draw(st.integers(1, 10))
    out, end, farthest = [], 0, 0
    for a in range(draw(st.integers(1, 4))):
        start = 0 if a == 0 else draw(st.integers(max(0, farthest - EMA_TRAIL + 1), end))
        rewards = draw(st.lists(st.floats(-5, 5), min_size=1, max_size=40))
        out.append((a, start, rewards))
        end = start + len(rewards)
        farthest = max(farthest, end)
    return out, window


@settings(max_examples=200, deadline=None)
@given(attempts(), st.floats(0.05, 1.0), st.data())
def test_any_resumes_give_the_window_and_ema_of_the_steps_that_stand(plan, alpha, data) -> None:
    runs, window = plan
    effective: dict[int, float] = {}
    deliveries = []
    for attempt, start, rewards in runs:
        for i, r in enumerate(rewards):
            effective = {s: v for s, v in effective.items() if s < start} if i == 0 else effective
            effective[start + i] = r
            deliveries.append((start + i, r, attempt))
            if deliveries and data.draw(st.booleans()):
                deliveries.append(data.draw(st.sampled_from(deliveries)))  # a redelivery, maybe stale
    state = SmoothingState()
    for step, r, attempt in deliveries:
        state, _ = add_reward(state, step, r, window, alpha, f"{attempt}-{step}", attempt)
    steps = sorted(effective)
    assert [p.step for p in state.points] == steps[-len(state.points):]  # a suffix, no step twice
    assert all(p.reward == effective[p.step] for p in state.points)
    if len(runs[-1][2]) >= window:
        assert len(state.points) == window
    ema = ema_fold(state.ema_base, [p.reward for p in state.points], alpha)
    assert ema is not None and close(ema, ema_fold(None, [effective[s] for s in steps], alpha))  # type: ignore[arg-type]


def step_ev(step: int, rank: int, reward: float, attempt: int, **kw) -> StepEvent:
    return StepEvent(run_id="run-x", node=f"n{rank}", rank=rank, step=step, epoch=0, reward=reward,
                     world_size=2, attempt=attempt, ts=1000.0 + 100 * attempt + step,
                     event_id=f"a{attempt}-s{step}-r{rank}", **kw)


def test_a_resumed_run_through_the_processor_replaces_its_points_and_re_arms_decisions() -> None:
    cfg = RunConfig(window=3, throughput_min_samples=3, throughput_cooldown_steps=0)
    state, points = RunState("run-x"), {}
    for attempt, steps in ((0, range(10)), (1, range(6, 12))):
        for step in steps:
            for rank in (0, 1):
                tp = 100.0 if not (attempt == 1 and step == 7) else 10.0
                state, out = on_step(state, step_ev(step, rank, float(attempt) + rank, attempt, throughput=tp),
                                     float(step), cfg)
                for o in out:
                    if o.event.type == "reward_smoothed":
                        points.setdefault(o.event.step, []).append(o.event)
                    if o.event.type == "alert":
                        assert (o.event.kind, o.event.step) == ("throughput_drop", 7)
    # one point per (step, attempt); a replaced step keeps its event id (FINAL keeps the later one)
    assert [len(points[s]) for s in range(12)] == [1] * 6 + [2] * 4 + [1] * 2
    assert points[7][1].event_id == points[7][0].event_id == derived_id("reward_smoothed", "run-x", 7)
    assert [p.reward for p in points[7]] == [0.5, 1.5]
    assert state.smoothing.attempt == 1 and state.lifecycle.attempt == 1
    # a late report of attempt 0 for a replaced step adds nothing
    _, out = on_step(state, step_ev(9, 1, 0.0, 0), 20.0, cfg)
    assert out == []
