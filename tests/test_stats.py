"""The readers' statistics (areal_metrics.stats): known values, and properties over random inputs."""

from __future__ import annotations

import math
import random

from hypothesis import given
from hypothesis import strategies as st

from areal_metrics import stats


def test_wilson_known_values() -> None:
    low, high = stats.wilson(10, 100)  # the textbook case: 10 / 100 -> [0.0552, 0.1744]
    assert math.isclose(low, 0.05523, abs_tol=1e-4) and math.isclose(high, 0.17437, abs_tol=1e-4)
    assert stats.wilson(0, 0) == (0.0, 1.0)
    low, high = stats.wilson(0, 20)
    assert low == 0.0 and 0.15 < high < 0.17


@given(st.integers(0, 500), st.integers(1, 500))
def test_wilson_holds_the_estimate(k: int, n: int) -> None:
    k = min(k, n)
    low, high = stats.wilson(k, n)
    assert 0.0 <= low <= k / n <= high <= 1.0


def test_wilson_covers_about_95_percent() -> None:
    rng = random.Random(7)
    p, n, trials = 0.2, 128, 4000
    hits = 0
    for _ in range(trials):
        k = sum(rng.random() < p for _ in range(n))
        low, high = stats.wilson(k, n)
        hits += low <= p <= high
    assert 0.93 <= hits / trials <= 0.97


def test_design_effect_widens_only_clustered_verdicts() -> None:
    independent = [1, 0, 0, 1, 0, 1, 1, 0] * 16
    clustered = [1, 1, 1, 1] * 16 + [0, 0, 0, 0] * 16  # prompts all-right or all-wrong
    assert stats.design_effect(independent, 4) == 1.0
    assert math.isclose(stats.design_effect(clustered, 4), 4.0)
    low_i, high_i = stats.accuracy_interval(independent, 1)
    low_c, high_c = stats.accuracy_interval(clustered, 4)
    assert high_c - low_c > 1.5 * (high_i - low_i)


def test_t_interval_known_values() -> None:
    r = stats.t_interval([0.1, 0.2, 0.3])  # mean 0.2, sd 0.1, t(2) = 4.303
    assert math.isclose(r.mean, 0.2) and math.isclose(r.ci_high - r.mean, 4.303 * 0.1 / math.sqrt(3), rel_tol=1e-9)
    one = stats.t_interval([0.4])
    assert one.mean == 0.4 and one.ci_low is None and one.ci_high is None


def test_t_interval_is_not_the_range() -> None:
    r = stats.t_interval([0.10, 0.14])  # two seeds: the t-interval is far wider than min..max
    assert r.ci_low is not None and r.ci_high is not None
    assert r.ci_low < 0.10 - 0.1 and r.ci_high > 0.14 + 0.1


def test_sign_test_known_values() -> None:
    assert stats.binomial_two_sided(0, 0) == 1.0
    assert math.isclose(stats.binomial_two_sided(9, 12), 2 * (1 + 12 + 66 + 220) / 4096)  # 0.146
    r = stats.sign_test([1, 1, 1, 1, 1, 1, 1, 1, 0, 0, -1])
    assert (r.n, r.positive, r.negative) == (11, 8, 1)
    assert math.isclose(r.p_value, 2 * (1 + 9) / 512)


@given(st.lists(st.integers(-1, 1), max_size=60))
def test_sign_test_is_symmetric(diffs: list[int]) -> None:
    a = stats.sign_test(diffs)
    b = stats.sign_test([-d for d in diffs])
    assert math.isclose(a.p_value, b.p_value) and 0.0 < a.p_value <= 1.0


def test_node_majority_leaves_ties_undecided() -> None:
    nodes = [{0: 1, 1: 1, 2: 0}, {0: 1, 1: 0, 2: 0, 3: 1}, {1: 1, 2: 1}]
    assert stats.node_majority(nodes) == {0: 1, 1: 1, 2: 0, 3: 1}
    assert stats.node_majority([{0: 1}, {0: 0}]) == {}


def test_window_ids() -> None:
    assert stats.window_ids(3) == [0, 1, 2]
    assert stats.window_ids(4, offset=6, total=8) == [6, 7, 0, 1]
