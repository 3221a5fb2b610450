"""The sliding average and EMA against a straightforward reference."""

from __future__ import annotations

import math
import random

from hypothesis import example, given, settings
from hypothesis import strategies as st

from areal_metrics.streams.state import codec
from areal_metrics.streams.core.smoothing import SmoothingState, add_reward, ema_fold, ls_slope


def reference(rewards: list[float], window: int, alpha: float) -> list[tuple[float, float, float]]:
    """(sliding_avg, ema, slope) after each step of an in-order sequence, computed the long way."""
    out = []
    ema = None
    for i, r in enumerate(rewards):
        ema = r if ema is None else alpha * r + (1 - alpha) * ema
        win = rewards[max(0, i - window + 1): i + 1]
        steps = list(range(max(0, i - window + 1), i + 1))
        n = len(win)
        if n < 2:
            slope = 0.0
        else:
            mx, my = sum(steps) / n, sum(win) / n
            slope = sum((x - mx) * (y - my) for x, y in zip(steps, win)) / sum((x - mx) ** 2 for x in steps)
        out.append((sum(win) / n, ema, slope))
    return out


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


rewards_st = st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=80)


@settings(max_examples=200, deadline=None)
@given(rewards_st, st.integers(1, 25), st.floats(0.01, 1.0))
def test_in_order_equals_reference(rewards: list[float], window: int, alpha: float) -> None:
    state = SmoothingState()
    expected = reference(rewards, window, alpha)
    for step, r in enumerate(rewards):
        state, outcome = add_reward(state, step, r, window, alpha)
        assert outcome.kind == "new"
        p = outcome.point
        assert p is not None and p.step == step and p.window == min(step + 1, window)
        avg, ema, slope = expected[step]
        assert close(p.sliding_avg, avg) and close(p.ema, ema) and close(p.slope, slope)


@settings(max_examples=200, deadline=None)
@given(rewards_st, st.integers(2, 25), st.floats(0.01, 1.0), st.randoms(use_true_random=False), st.data())
def test_duplicates_and_bounded_disorder_end_equal_to_reference(
    rewards: list[float], window: int, alpha: float, rnd: random.Random, data: st.DataObject
) -> None:
    # Shuffle within blocks shorter than the window (disorder the window can absorb) and
    # deliver some steps twice, with a different reward the second time.
    block = data.draw(st.integers(1, window))
    order: list[int] = []
    for start in range(0, len(rewards), block):
        chunk = list(range(start, min(start + block, len(rewards))))
        rnd.shuffle(chunk)
        order.extend(chunk)
    deliveries = []
    for step in order:
        deliveries.append((step, rewards[step]))
        if rnd.random() < 0.3:
            deliveries.append((step, rewards[step] + 100.0))  # a repeat must not count
    state = SmoothingState()
    for step, r in deliveries:
        state, outcome = add_reward(state, step, r, window, alpha)
        assert outcome.kind != "too_late"
    avg, ema, slope = reference(rewards, window, alpha)[-1]
    win = [p.reward for p in state.points]
    assert [p.step for p in state.points] == list(range(max(0, len(rewards) - window), len(rewards)))
    assert close(sum(win) / len(win), avg)
    assert close(ema_fold(state.ema_base, win, alpha), ema)  # type: ignore[arg-type]
    assert close(ls_slope([p.step for p in state.points], win), slope)


def test_duplicate_returns_the_point_emitted_first() -> None:
    state = SmoothingState()
    state, first = add_reward(state, 0, 1.0, 3, 0.5, "ev-0")
    state, _ = add_reward(state, 1, 3.0, 3, 0.5, "ev-1")
    same, again = add_reward(state, 0, 9.0, 3, 0.5, "ev-0")
    assert again.kind == "duplicate" and again.point == first.point and same == state


def test_step_older_than_the_full_window_is_too_late() -> None:
    state = SmoothingState()
    for step in (5, 6, 7):
        state, _ = add_reward(state, step, 1.0, 3, 0.5)
    after, outcome = add_reward(state, 2, 50.0, 3, 0.5)
    assert outcome.kind == "too_late" and outcome.point is None and after == state


def test_late_step_inside_the_window_is_inserted() -> None:
    state = SmoothingState()
    state, _ = add_reward(state, 0, 0.0, 4, 1.0)
    state, _ = add_reward(state, 2, 2.0, 4, 1.0)
    state, outcome = add_reward(state, 1, 1.0, 4, 1.0)
    assert outcome.kind == "late" and not outcome.is_newest
    assert [p.step for p in state.points] == [0, 1, 2]
    assert outcome.point is not None and outcome.point.sliding_avg == 1.0 and outcome.point.slope == 1.0
    # alpha = 1: the EMA is the reward of the highest step, not of the latest arrival
    assert outcome.point.ema == 2.0


def test_state_round_trips_through_json_dict() -> None:
    state = SmoothingState()
    for step in range(7):
        state, _ = add_reward(state, step, step * 0.5, 4, 0.3, f"e{step}")
    assert codec.loads(SmoothingState, codec.dumps(state)) == state


def _reference_slope(steps: list[int], values: list[float]) -> float:
    """The slope as the first version computed it, sum by sum (the fit must give the same bits)."""
    n = len(steps)
    if n < 2:
        return 0.0
    mean_x, mean_y = sum(steps) / n, sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in steps)
    if sxx == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, values)) / sxx


def _reference_se(steps: list[int], values: list[float]) -> float:
    n = len(steps)
    if n < 3:
        return 0.0
    mean_x, mean_y = sum(steps) / n, sum(values) / n
    sxx = sum((x - mean_x) ** 2 for x in steps)
    if sxx == 0:
        return 0.0
    slope = _reference_slope(steps, values)
    residual = sum((y - mean_y - slope * (x - mean_x)) ** 2 for x, y in zip(steps, values))
    return math.sqrt(max(0.0, residual) / (n - 2) / sxx)


@given(st.lists(st.tuples(st.integers(0, 10**6), st.floats(-1e6, 1e6)), max_size=40))
# found by CI: r * r and r ** 2 (C's pow) round this residual differently
@example([(382, 0.0), (500, 285543.32544702035), (1010, -617672.4158120586), (1328, 0.0)])
def test_the_fit_gives_the_very_bits_of_the_first_version(points: list[tuple[int, float]]) -> None:
    from areal_metrics.streams.core.smoothing import ls_slope_se

    steps, values = [p[0] for p in points], [p[1] for p in points]
    assert ls_slope(steps, values) == _reference_slope(steps, values)
    assert ls_slope_se(steps, values) == _reference_se(steps, values)


@given(first=st.integers(0, 2**53), n=st.integers(0, 40), gap=st.sampled_from([0, 0, 0, 1, 7]),
       values=st.lists(st.floats(-1e6, 1e6), min_size=40, max_size=40))
@example(first=2**50 - 10, n=20, gap=0, values=[0.1 * i for i in range(40)])
@example(first=2**50 - 30, n=20, gap=0, values=[(-1.0) ** i for i in range(40)])
@example(first=2**52 + 1, n=20, gap=0, values=[(-1.0) ** i * 0.37 * i for i in range(40)])  # mean_x inexact
def test_the_window_fit_gives_the_bits_of_the_full_fit(first: int, n: int, gap: int, values: list[float]) -> None:
    """A window of consecutive steps takes dx and sxx from a cache; any window, the same bits."""
    from areal_metrics.streams.core.smoothing import _fit, _window_fit

    steps = [first + i for i in range(n)]
    if gap and n > 1:
        steps[n // 2:] = [s + gap for s in steps[n // 2:]]  # not consecutive: the full fit
    assert _window_fit(steps, values[:n]) == _fit(steps, values[:n], with_se=True)
