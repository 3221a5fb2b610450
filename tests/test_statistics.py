"""The one statistics module (areal_metrics.producers.contract.statistics) held to scipy.stats and
statsmodels over random inputs, its known values, and the consensus interval's coverage."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import scipy.stats
import statsmodels.api as sm
from hypothesis import given, settings
from hypothesis import strategies as st
from statsmodels.stats.proportion import proportion_confint

from areal_metrics.producers.contract import statistics as S

PROPS = settings(max_examples=300, deadline=None)


# ------------------------------------------------------------------ against the libraries


@PROPS
@given(st.integers(0, 2000), st.integers(1, 2000), st.sampled_from([0.90, 0.95, 0.99]))
def test_wilson_is_statsmodels_wilson(k: int, n: int, confidence: float) -> None:
    k = min(k, n)
    z = scipy.stats.norm.ppf(0.5 + confidence / 2)
    low, high = S.wilson(k / n, n, z)
    ref_low, ref_high = proportion_confint(k, n, alpha=1 - confidence, method="wilson")
    assert low == pytest.approx(ref_low, abs=1e-9) and high == pytest.approx(ref_high, abs=1e-9)
    assert 0.0 <= low <= k / n <= high <= 1.0


@PROPS
@given(st.integers(0, 2000), st.integers(1, 2000))
def test_clopper_pearson_is_statsmodels_beta(k: int, n: int) -> None:
    k = min(k, n)
    low, high = S.clopper_pearson(k, n)
    ref_low, ref_high = proportion_confint(k, n, alpha=0.05, method="beta")
    assert low == pytest.approx(ref_low, abs=1e-9) and high == pytest.approx(ref_high, abs=1e-9)


@PROPS
@given(st.floats(0.001, 0.999), st.floats(0.05, 500), st.floats(0.05, 500))
def test_beta_quantile_and_incomplete_beta_are_scipys(q: float, a: float, b: float) -> None:
    x = S.beta_quantile(q, a, b)
    assert x == pytest.approx(scipy.stats.beta.ppf(q, a, b), abs=1e-9)
    assert S.beta_regularized(a, b, x) == pytest.approx(scipy.stats.beta.cdf(x, a, b), abs=1e-10)


@PROPS
@given(st.integers(1, 2000), st.floats(0.5005, 0.9995))
def test_t_quantile_is_scipys(df: int, q: float) -> None:
    assert S.t_quantile(float(df), q) == pytest.approx(scipy.stats.t.ppf(q, df), rel=1e-9, abs=1e-9)
    assert S.t_quantile(float(df), 1 - q) == pytest.approx(scipy.stats.t.ppf(1 - q, df), rel=1e-9, abs=1e-9)


@PROPS
@given(st.floats(-50, 50), st.floats(0.5, 400))
def test_t_cdf_is_scipys(t: float, df: float) -> None:
    # 1e-9: scipy's own t.cdf loses about 3e-10 near t = 0 (df 1, t 5.5e-8 reads 0.50000001775 where
    # the Cauchy's closed form, and ours, read 0.50000001742); the test below holds ours to 1e-15 there
    assert S.t_cdf(t, df) == pytest.approx(scipy.stats.t.cdf(t, df), abs=1e-9)


@PROPS
@given(st.floats(-1e-3, 1e-3))
def test_t_cdf_near_zero_is_the_cauchys_closed_form(t: float) -> None:
    assert S.t_cdf(t, 1.0) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-15)


@PROPS
@given(st.lists(st.floats(-10, 10), min_size=2, max_size=40), st.sampled_from([0.9, 0.95, 0.99]))
def test_t_interval_is_scipys(values: list[float], confidence: float) -> None:
    r = S.t_interval(values, confidence)
    sem = scipy.stats.sem(values)
    if not sem > 0:
        assert r.ci_low == pytest.approx(r.mean) and r.ci_high == pytest.approx(r.mean)
        return
    low, high = scipy.stats.t.interval(confidence, len(values) - 1, loc=np.mean(values), scale=sem)
    assert r.ci_low == pytest.approx(low, abs=1e-9) and r.ci_high == pytest.approx(high, abs=1e-9)


@PROPS
@given(st.integers(0, 400), st.integers(0, 400))
def test_the_exact_sign_test_is_scipys_binomtest(k: int, n: int) -> None:
    n = max(n, k)
    expected = 1.0 if n == 0 else scipy.stats.binomtest(k, n, 0.5).pvalue
    assert S.binomial_two_sided(k, n) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@PROPS
@given(st.integers(1000, 200_000), st.floats(0.0, 1.0))
def test_the_sign_test_holds_past_a_thousand_pairs(n: int, share: float) -> None:
    """2.0 ** n overflowed a float from 1,024 pairs (a GSM8K test set's 1,319 prompts): `compare` crashed."""
    k = round(n * (0.5 + (share - 0.5) * 0.05))  # near the middle, where the p-values are not all 0
    expected = scipy.stats.binomtest(k, n, 0.5).pvalue
    assert S.binomial_two_sided(k, n) == pytest.approx(expected, rel=1e-7, abs=1e-300)
    assert S.binomial_two_sided(700, 1319) == pytest.approx(scipy.stats.binomtest(700, 1319, 0.5).pvalue, rel=1e-9)


@PROPS
@given(st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=8), min_size=2, max_size=40))
def test_the_cluster_robust_variance_is_statsmodels_ols_with_clusters(clusters: list[list[int]]) -> None:
    y = np.array([v for c in clusters for v in c], dtype=float)
    groups = np.array([g for g, c in enumerate(clusters) for _ in c])
    cl = dict(enumerate(clusters))
    ours = S.cluster_variance(cl)
    if y.min() == y.max():
        assert ours == 0.0
        return
    fit = sm.OLS(y, np.ones_like(y)).fit(cov_type="cluster", cov_kwds={"groups": groups})
    assert ours == pytest.approx(float(fit.cov_params()[0, 0]), rel=1e-9, abs=1e-15)
    p = y.mean()
    n = len(y)
    assert 1.0 <= S.effective_n(cl) <= n
    if len(clusters) == n:  # one outcome per cluster: independent samples, n itself
        assert S.effective_n(cl) == n
    else:
        assert S.effective_n(cl) == pytest.approx(min(n, max(1.0, p * (1 - p) / ours)) if ours > 0 else n)


# ------------------------------------------------------------------ known values and rules


def test_known_values() -> None:
    low, high = S.wilson(0.1, 100)  # the textbook case: 10 / 100 -> [0.0552, 0.1744]
    assert math.isclose(low, 0.05523, abs_tol=1e-4) and math.isclose(high, 0.17437, abs_tol=1e-4)
    assert S.wilson(0, 0) == (0.0, 1.0) and S.wilson(0.0, 20)[0] == 0.0 and S.wilson(1.0, 20)[1] == 1.0
    r = S.t_interval([0.1, 0.2, 0.3])  # mean 0.2, sd 0.1, t(2) = 4.303
    assert math.isclose(r.ci_high - r.mean, 4.302652729911275 * 0.1 / math.sqrt(3), rel_tol=1e-9)
    one = S.t_interval([0.4])
    assert one.mean == 0.4 and one.ci_low is None and one.ci_high is None
    assert S.binomial_two_sided(0, 0) == 1.0
    t = S.sign_test([1, 1, 1, 1, 1, 1, 1, 1, 0, 0, -1])
    assert (t.n, t.positive, t.negative) == (11, 8, 1) and t.p_value == pytest.approx(20 / 512)
    with pytest.raises(ValueError):
        S.t_quantile(0.0)


def test_design_effect_widens_only_clustered_verdicts() -> None:
    independent = S.clusters_of([1, 0, 0, 1, 0, 1, 1, 0] * 16, 4)  # every prompt 2 of 4
    clustered = S.clusters_of([1, 1, 1, 1] * 16 + [0, 0, 0, 0] * 16, 4)  # prompts all-right or all-wrong
    assert S.design_effect(independent) == 1.0
    assert S.effective_n(clustered) == pytest.approx(32 * 31 / 32)  # 32 prompts, CR1's G/(G-1)
    low_i, high_i = S.proportion_interval(independent)
    low_c, high_c = S.proportion_interval(clustered)
    assert high_c - low_c > 1.5 * (high_i - low_i)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 9), st.integers(0, 9), st.integers(1, 6))
def test_majority_is_a_strict_majority_of_the_replicas(ones: int, zeros: int, replicas: int) -> None:
    side = S.majority(ones, zeros, replicas)
    need = replicas // 2 + 1
    if ones > zeros and ones >= need:
        assert side == 1
    elif zeros > ones and zeros >= need:
        assert side == 0
    else:
        assert side is None
    # node_majority uses the same rule, per sample
    nodes = [{0: 1} for _ in range(ones)] + [{0: 0} for _ in range(zeros)]
    assert S.node_majority(nodes, replicas).get(0) == side


def test_node_majority_with_the_nodes_seen_as_the_replicas() -> None:
    nodes = [{0: 1, 1: 1, 2: 0, 3: 1}, {0: 1, 1: 0, 2: 0}, {0: 0, 1: 1, 2: 1}]
    assert S.node_majority(nodes) == {0: 1, 1: 1, 2: 0, 3: 1}
    assert S.node_majority([{0: 1}, {0: 0}]) == {}
    assert S.node_majority([{0: 1}], replicas=2) == {}  # one vote of two replicas decides nothing


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), min_size=2, max_size=30))
def test_the_bounded_interval_holds_every_way_the_undecided_could_fall(cells: list[tuple[int, int]]) -> None:
    """Each prompt: (right, wrong) decided samples; one more sample undecided in every other prompt."""
    decided = {g: [1] * r + [0] * w for g, (r, w) in enumerate(cells)}
    undecided = {g: 1 for g in range(0, len(cells), 2)}
    low, high = S.bounded_interval(decided, undecided)
    all_wrong = S.proportion_interval({g: decided[g] + [0] * undecided.get(g, 0) for g in decided})
    all_right = S.proportion_interval({g: decided[g] + [1] * undecided.get(g, 0) for g in decided})
    assert (low, high) == (all_wrong[0], all_right[1])
    n = sum(len(v) for v in decided.values()) + len(undecided)
    ones = sum(map(sum, decided.values()))
    assert low <= ones / n and (ones + len(undecided)) / n <= high  # both extreme accuracies are inside
    assert S.bounded_interval(decided, {}) == S.proportion_interval(decided)


# ------------------------------------------------------------------ coverage (issue 40, item 7)


def coverage(prompts: int, per_prompt: int, mean: float, icc: float, trials: int, seed: int) -> float:
    """Share of rounds whose interval covers `mean`, the accuracy over the prompt population: each
    prompt's solve rate ~ Beta with that mean and intra-prompt correlation `icc` (prompt clustering)."""
    rng = np.random.default_rng(seed)
    a, b = mean * (1 - icc) / icc, (1 - mean) * (1 - icc) / icc
    hits = 0
    for _ in range(trials):
        p = rng.beta(a, b, prompts)
        v = (rng.random((prompts, per_prompt)) < p[:, None]).astype(int)
        low, high = S.proportion_interval({g: v[g].tolist() for g in range(prompts)})
        hits += low <= mean <= high
    return hits / trials


@pytest.mark.parametrize("prompts,mean,icc", [
    (32, 0.05, 0.3), (32, 0.05, 0.5), (32, 0.1, 0.3), (32, 0.5, 0.3),
    (64, 0.05, 0.3), (128, 0.05, 0.3), (128, 0.5, 0.1), (128, 0.5, 0.3),
])
def test_the_consensus_interval_covers_from_32x4_at_005_to_128x4_at_05(prompts: int, mean: float, icc: float) -> None:
    """Seeded, 2000 rounds each (Monte-Carlo SE of a 95 % share: 0.5 points). Wilson with the
    normal quantile on the effective size covered 92.1 % at (32, 0.05, 0.3) in the same model."""
    assert coverage(prompts, 4, mean, icc, 2000, seed=prompts * 1000 + int(mean * 100) + int(icc * 10)) >= 0.94


def test_wilson_covers_about_95_percent_on_independent_samples() -> None:
    rng = random.Random(7)
    p, n, trials = 0.2, 128, 4000
    hits = 0
    for _ in range(trials):
        k = sum(rng.random() < p for _ in range(n))
        low, high = S.wilson(k / n, n)
        hits += low <= p <= high
    assert 0.93 <= hits / trials <= 0.97


def _cusum_passes(z: np.ndarray, k: float, h: float) -> np.ndarray:
    """Per run (row): whether S = max(0, S + z - k) from 0 passes h within the row's rounds."""
    s = np.zeros(z.shape[0])
    passed = np.zeros(z.shape[0], dtype=bool)
    for column in z.T:
        s = np.maximum(0.0, s + column - k)
        passed |= s > h
    return passed


@pytest.mark.parametrize(("k", "h", "rounds"), [(1.959964, 1.65, 200), (1.959964, 1.75, 150), (1.0, 2.5, 100),
                                                (0.5, 3.0, 200), (1.644854, 0.0, 30)])
def test_the_cusum_false_alarm_probability_is_the_monte_carlo_one(k: float, h: float, rounds: int) -> None:
    """Seeded, 100,000 runs of N(0, 1) rounds each: within 4 Monte-Carlo standard errors."""
    z = np.random.default_rng(int(k * 1000 + h * 10 + rounds)).standard_normal((100_000, rounds))
    measured = _cusum_passes(z, k, h).mean()
    exact = S.cusum_false_alarm(k, h, rounds)
    assert abs(measured - exact) <= 4 * math.sqrt(exact * (1 - exact) / 100_000) + 1e-4
    # one round: a cut when it alone passes k + h
    assert S.cusum_false_alarm(k, h, 1) == pytest.approx(1 - scipy.stats.norm.cdf(k + h), abs=1e-9)


def test_the_cusum_limit_spends_exactly_its_share_over_the_horizon() -> None:
    # the eval loop's design at alpha 0.05: k = 1.96, cut within 200 independent rounds at the threshold
    # in 2.5 % of runs. Siegmund's average-run-length approximation (ARL = 200 / 0.025 rounds, h = 1.65)
    # spent 3.6 %: its false alarms come early (a geometric run length), not spread evenly.
    h = S.cusum_horizon_limit(1.959964, 200, 0.025)
    assert S.cusum_false_alarm(1.959964, h, 200) <= 0.025 < S.cusum_false_alarm(1.959964, h - 1e-3, 200)
    assert S.cusum_false_alarm(1.959964, 1.65, 200) == pytest.approx(0.0356, abs=5e-4)
    assert 1.70 < h < 1.80
    # past the horizon the same limit goes on spending: about alpha/2 per further horizon
    assert S.cusum_false_alarm(1.959964, h, 400) == pytest.approx(0.049, abs=1e-3)
    # longer horizons ask for a higher limit, and a million rounds is computed (the geometric tail)
    assert h < S.cusum_horizon_limit(1.959964, 2000, 0.025) < S.cusum_horizon_limit(1.959964, 1_000_000, 0.025)
    with pytest.raises(ValueError):
        S.cusum_horizon_limit(1.959964, 0, 0.025)


def test_a_rule_over_windows_of_one_or_two_rounds_needs_the_cusums_limit() -> None:
    """Why the threshold CUSUM's power within two rounds is what it is (docs/STREAMS.md): a rule that
    cuts when the last round, or the last two, pass k = 1.96 by more than h, and remembers nothing
    older, needs the same limit as the CUSUM (1.75) to spend 2.5 % over 200 N(0, 1) rounds: the
    CUSUM's longer memory costs it no power against a drop found within two rounds. Seeded, 100,000
    runs (MC SE 0.05 points)."""
    k, h = 1.959964, S.cusum_horizon_limit(1.959964, 200, 0.025)
    excess = np.random.default_rng(5).standard_normal((100_000, 200)) - k
    two = np.maximum(excess[:, 1:], excess[:, 1:] + excess[:, :-1])
    spent = lambda limit: float(((excess[:, 0] > limit) | (two > limit).any(axis=1)).mean())  # noqa: E731
    assert spent(h - 0.05) > 0.025 + 3 * 0.0005 and spent(h + 0.05) < 0.025 - 3 * 0.0005


def test_an_interval_of_no_number_is_everything_never_a_confident_nothing() -> None:
    """clopper_pearson(nan, 10) read (2.7e-20, 2.7e-20): a confident-looking interval of nothing."""
    nan = float("nan")
    for interval in (S.clopper_pearson(nan, 10), S.clopper_pearson(3, nan), S.clopper_pearson(3, math.inf),
                     S.wilson(nan, 10), S.wilson(0.5, nan)):
        assert interval == (0.0, 1.0)
