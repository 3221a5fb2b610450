"""The project's one statistics module: every interval, size and test a number carries. Pure, stdlib only.

The worker (streams.core), the readers (`report`, `compare`, the demo's checks) and the reference
trainer (areal_train) import these functions and nothing else computes them; tests/test_statistics.py
holds each to scipy.stats and statsmodels over random inputs. It sits on the ground floor
(producers.contract) because that is the one room every other room may import.

Proportions
- `wilson(p, n, z)`: the Wilson score interval of a proportion `p` on `n` samples (`n` may be an
  effective, fractional size); (0, 1) with no samples; exactly 0 (1) at p = 0 (1).
- `cluster_variance(clusters)`: the cluster-robust (CR1 sandwich) variance of the mean of 0/1
  outcomes grouped in clusters (one cluster per prompt): G/(G-1) * sum_g (sum of cluster g's
  residuals)^2 / n^2, what statsmodels' OLS of the outcomes on a constant with
  cov_type="cluster" gives.
- `effective_n(clusters)`: the Kish effective size of that mean, p(1-p) / cluster_variance,
  within [1, n]; `design_effect(clusters)` = n / effective_n; `interval_n(clusters)`: the size
  a round's interval stands on and the closed loop weighs it by (the number of clusters when
  every outcome is alike).
- `clopper_pearson(successes, n, confidence)`: the exact (beta) interval, `n` possibly effective.
- `proportion_interval(clusters, confidence)`: the interval the consensus carries (Korn and
  Graubard's for clustered samples): Clopper-Pearson on the effective size, scaled for the G-1
  degrees of freedom of G prompts; with no success the effective size is G. Its coverage of the
  accuracy over the prompt population is measured in tests/test_statistics.py (at least 94 %
  from 32 prompts x 4 samples at accuracy 0.05 to 128 x 4 at 0.5, prompts' solve rates drawn
  from a Beta with intra-prompt correlation 0.1 to 0.5); Wilson with the normal quantile on
  the effective size covered 91-92 % at 32 x 4 and 0.05.
- `bounded_interval(clusters, undecided, confidence)`: the interval of the accuracy over ALL the
  samples of a round when some are undecided: the low end counts every undecided sample wrong,
  the high end right, each with its sampling interval (`proportion_interval`); `side_reading`:
  the (accuracy, size) of one end, which the closed loop reads too (`with_undecided`).

The vote
- `majority(ones, zeros, replicas)`: 1 or 0 when a side holds a strict majority of the sample's
  `replicas` (at least replicas // 2 + 1 votes, and more than the other side), else None
  (undecided). The worker's vote and `compare`'s per-sample verdicts both use it.
- `node_majority(nodes, replicas)`: sample -> verdict over several nodes' verdicts by `majority`.

Means and tests
- `t_quantile(df, q)`: Student's t quantile (stdlib: the regularized incomplete beta, inverted).
- `t_interval(values, confidence)`: mean and Student-t interval over independent values (one per run).
- `welch(a, b)`: mean(b) - mean(a) over runs with Welch's 95 % interval and two-sided p-value
  (scipy.stats.ttest_ind(b, a, equal_var=False)); `format_p(p)`: `p < 0.001` below 0.001.
- `binomial_two_sided(k, n)`: the exact two-sided p-value of k successes in n under p = 1/2
  (scipy.stats.binomtest(k, n).pvalue); `sign_test(differences)`: the exact sign test.
- `z_one_sided(alpha)`, `look_alpha(alpha, k)`, `slope_bound(points, z)`,
  `proportion_variance(p, n_eff)`: the closed loop's helpers (areal_metrics.streams.core.eval_loop);
  `cusum_false_alarm(k, h, rounds)`: P(a one-sided CUSUM of independent N(0, 1) increments with
  reference k passes its limit h within `rounds` rounds), from its run-length distribution
  (the integral equation at 32 Gauss-Legendre nodes; checked against Monte Carlo);
  `cusum_horizon_limit(k, rounds, alpha)`: the smallest h with that probability <= alpha. (It
  replaced Siegmund's average-run-length approximation with ARL = rounds / alpha, which spent
  3.6 % where 2.5 % was asked at k 1.96 over 200 rounds: tests/test_statistics.py.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

Z95 = NormalDist().inv_cdf(0.975)  # two-sided 95 %: 1.95996...

Clusters = Mapping[int, Sequence[int]]  # cluster (prompt) -> its 0/1 outcomes


# ------------------------------------------------------------------ quantiles


def z_one_sided(alpha: float) -> float:
    """The normal quantile with `alpha` above it."""
    return NormalDist().inv_cdf(1.0 - min(max(alpha, 1e-15), 0.5))


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def beta_regularized(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, not {df}")
    t2 = t * t
    if t2 < df:  # near 0: P(|T| < |t|) = I_y(1/2, df/2), y = t^2 / (df + t^2), without 1 - x cancelling
        inner = 0.5 * beta_regularized(0.5, df / 2.0, t2 / (df + t2))
        return 0.5 + inner if t > 0 else 0.5 - inner
    tail = 0.5 * beta_regularized(df / 2.0, 0.5, df / (df + t2))
    return 1.0 - tail if t > 0 else tail


@lru_cache(maxsize=4096)
def t_quantile(df: float, q: float = 0.975) -> float:
    """Student's t quantile: the t with P(T <= t) = q (0 < q < 1), `df` > 0 degrees of freedom."""
    if df <= 0:
        raise ValueError("a t quantile needs at least 1 degree of freedom (2 or more values)")
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be within (0, 1), not {q}")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -t_quantile(df, 1.0 - q)
    low, high = 0.0, max(1.0, NormalDist().inv_cdf(q))
    while t_cdf(high, df) < q:
        low, high = high, high * 2.0
    for _ in range(200):  # bisection: t_cdf is monotone; 200 halvings reach double precision
        mid = (low + high) / 2.0
        if mid in (low, high):
            break
        if t_cdf(mid, df) < q:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


# ------------------------------------------------------------------ proportions


def wilson(p: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion `p` on `n` (possibly effective) samples; (0, 1)
    when there are none (or `p` or `n` is not a number). Exact at the ends: 0 when p is 0, 1 when p is 1."""
    if not n > 0 or p != p:  # NaN compares false: no samples said anything
        return 0.0, 1.0
    p = min(max(p, 0.0), 1.0)
    z2n = z * z / n
    centre = (p + z2n / 2) / (1 + z2n)
    half = z * math.sqrt(p * (1 - p) / n + z2n / (4 * n)) / (1 + z2n)
    low = 0.0 if p == 0.0 else max(0.0, centre - half)
    high = 1.0 if p == 1.0 else min(1.0, centre + half)
    return low, high


def _sizes(clusters: Clusters) -> tuple[int, int, float]:
    """(outcomes, non-empty clusters, successes)."""
    filled = [c for c in clusters.values() if len(c)]
    return sum(len(c) for c in filled), len(filled), float(sum(sum(c) for c in filled))


def cluster_variance(clusters: Clusters) -> float:
    """The cluster-robust (CR1) variance of the mean of the outcomes: G/(G-1) * sum_g r_g^2 / n^2,
    r_g the sum of cluster g's residuals from the mean. Needs 2 or more clusters."""
    n, g, ones = _sizes(clusters)
    if g < 2:
        raise ValueError("a cluster-robust variance needs 2 or more clusters")
    p = ones / n
    residuals = sum((sum(c) - p * len(c)) ** 2 for c in clusters.values() if len(c))
    return g / (g - 1) * residuals / (n * n)


def effective_n(clusters: Clusters) -> float:
    """Kish effective sample size of the mean of 0/1 outcomes grouped in clusters (prompts):
    p(1-p) / cluster_variance, within [1, n]. One outcome per cluster: n itself; one cluster: 1;
    every outcome alike (p 0 or 1): n (no spread to estimate a design effect from)."""
    n, g, ones = _sizes(clusters)
    if n == 0:
        return 0.0
    if g == n:
        return float(n)
    if g < 2:
        return 1.0
    p = ones / n
    if p <= 0.0 or p >= 1.0:
        return float(n)
    var = cluster_variance(clusters)
    if var <= 0:
        return float(n)
    return min(float(n), max(1.0, p * (1 - p) / var))


def interval_n(clusters: Clusters) -> float:
    """The effective size a round's interval stands on (`proportion_interval`, before its G-1 degrees
    of freedom), and the one the closed loop weighs the round by: `effective_n`, or the number of
    clusters when every outcome is alike (the data cannot show the clustering); 0 with none."""
    n, g, ones = _sizes(clusters)
    if n == 0:
        return 0.0
    if g == n:
        return float(n)
    return float(g) if ones in (0.0, float(n)) else effective_n(clusters)


def with_undecided(clusters: Clusters, undecided: Clusters | Mapping[int, int], verdict: int) -> dict[int, list[int]]:
    """Every sample of a round: the decided verdicts by cluster, and each cluster's undecided samples
    (a count, or a list) counted `verdict`: 0 for the low end of `bounded_interval`, 1 for the high end."""
    counts = {c: (u if isinstance(u, int) else len(u)) for c, u in undecided.items()}
    return {c: [*clusters.get(c, ()), *([verdict] * counts.get(c, 0))] for c in set(clusters) | set(counts)}


def side_reading(clusters: Clusters, undecided: Clusters | Mapping[int, int], verdict: int) -> tuple[float, float]:
    """(accuracy, effective size) over every sample of a round with each undecided sample counted
    `verdict`: what that end of `bounded_interval` stands on, and what the closed loop reads of the
    round (one rule for both: the loop once scaled the decided samples' size instead)."""
    side = with_undecided(clusters, undecided, verdict)
    n, _, ones = _sizes(side)
    return (ones / n if n else 0.0), interval_n(side)


def design_effect(clusters: Clusters) -> float:
    """n / effective_n: how many samples count as one independent one (1 when there are none)."""
    n, _, _ = _sizes(clusters)
    eff = effective_n(clusters)
    return n / eff if eff > 0 else 1.0


def clusters_of(verdicts: Sequence[int], per_cluster: int, ids: Sequence[int] | None = None) -> dict[int, list[int]]:
    """Outcomes grouped by cluster: sample id // per_cluster (ids: the verdicts' sample ids, else 0..n-1)."""
    k = max(per_cluster, 1)
    out: dict[int, list[int]] = {}
    for sample, v in zip(ids if ids is not None else range(len(verdicts)), verdicts):
        out.setdefault(sample // k, []).append(int(v))
    return out


def beta_quantile(q: float, a: float, b: float) -> float:
    """The x with I_x(a, b) = q: the Beta(a, b) quantile (bisection to double precision)."""
    if not 0.0 <= q <= 1.0 or a <= 0 or b <= 0:
        raise ValueError(f"need 0 <= q <= 1 and a, b > 0 (q={q}, a={a}, b={b})")
    low, high = 0.0, 1.0
    for _ in range(64):
        mid = (low + high) / 2.0
        if beta_regularized(a, b, mid) < q:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


def clopper_pearson(successes: float, n: float, confidence: float = 0.95) -> tuple[float, float]:
    """The Clopper-Pearson ("exact", beta) interval of successes / n; `n` and `successes` may be
    fractional (an effective size). (0, 1) with no samples (or either is not a finite number)."""
    if not 0 < n < math.inf or successes != successes:  # NaN compares false
        return 0.0, 1.0
    x = min(max(successes, 0.0), n)
    tail = (1.0 - confidence) / 2.0
    low = 0.0 if x <= 0 else beta_quantile(tail, x, n - x + 1.0)
    high = 1.0 if x >= n else beta_quantile(1.0 - tail, x + 1.0, n - x)
    return low, high


def proportion_interval(clusters: Clusters, confidence: float = 0.95) -> tuple[float, float]:
    """The interval of the mean of clustered 0/1 outcomes (Korn and Graubard, 1998): Clopper-Pearson
    on the effective size, that size scaled by (t_{n-1} / t_{G-1})^2 for the G-1 degrees of
    freedom of G clusters. With no success (or no failure) the data cannot show the clustering, so
    the effective size is the number of clusters (as if each prompt's samples all agreed). One
    outcome per cluster: the plain Clopper-Pearson interval."""
    n, g, ones = _sizes(clusters)
    if n == 0:
        return 0.0, 1.0
    if g == n:
        return clopper_pearson(ones, n, confidence)
    eff = interval_n(clusters)
    if g >= 2:
        q = 0.5 + confidence / 2.0
        eff *= (t_quantile(float(n - 1), q) / t_quantile(float(g - 1), q)) ** 2
    return clopper_pearson(ones / n * eff, eff, confidence)


def bounded_interval(clusters: Clusters, undecided: Clusters | Mapping[int, int],
                     confidence: float = 0.95) -> tuple[float, float]:
    """The interval of the accuracy over every sample of a round, decided or not: `clusters` the
    decided samples' verdicts, `undecided` cluster -> its count (or list) of undecided samples.
    Low end: every undecided sample counted wrong; high end: right; each end that side's
    `proportion_interval` end. With none undecided, `proportion_interval(clusters)`."""
    if not any((u if isinstance(u, int) else len(u)) for u in undecided.values()):
        return proportion_interval(clusters, confidence)
    return (proportion_interval(with_undecided(clusters, undecided, 0), confidence)[0],
            proportion_interval(with_undecided(clusters, undecided, 1), confidence)[1])


def proportion_variance(p: float, n_eff: float) -> float:
    """The variance of a proportion estimated on `n_eff` effective samples, kept off 0 at the
    edges (a round at 0 % or 100 % is not exact): p is pulled in by half a sample."""
    if n_eff <= 0:
        return 0.25
    q = min(max(p, 0.5 / n_eff), 1 - 0.5 / n_eff)
    return q * (1 - q) / n_eff


# ------------------------------------------------------------------ the vote


def quorum(replicas: int) -> int:
    """Votes a side needs to decide a sample: a strict majority of its replicas."""
    return max(replicas, 1) // 2 + 1


def majority(ones: int, zeros: int, replicas: int) -> int | None:
    """A sample's verdict: the side with at least quorum(replicas) votes and more than the other,
    else None (undecided: a tie, or too few votes). Votes beyond `replicas` (an adjudicator) count."""
    if ones != zeros and max(ones, zeros) >= quorum(replicas):
        return 1 if ones > zeros else 0
    return None


def node_majority(nodes: Iterable[Mapping[int, int]], replicas: int | None = None) -> dict[int, int]:
    """sample -> verdict by `majority` over the nodes' verdicts (node: sample -> 0/1); undecided
    samples are left out. `replicas` None: each sample's replicas are the nodes that evaluated it."""
    ones: dict[int, int] = {}
    seen: dict[int, int] = {}
    for verdicts in nodes:
        for sample, v in verdicts.items():
            seen[sample] = seen.get(sample, 0) + 1
            ones[sample] = ones.get(sample, 0) + (1 if v else 0)
    out = {}
    for sample, count in seen.items():
        side = majority(ones[sample], count - ones[sample], count if replicas is None else replicas)
        if side is not None:
            out[sample] = side
    return out


# ------------------------------------------------------------------ means and tests


@dataclass(frozen=True)
class MeanInterval:
    n: int
    mean: float
    ci_low: float | None  # None with fewer than 2 values: no spread to measure
    ci_high: float | None


def t_interval(values: Sequence[float], confidence: float = 0.95) -> MeanInterval:
    """Mean and Student-t interval over independent values (one per run)."""
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return MeanInterval(n, mean, None, None)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(float(n - 1), 0.5 + confidence / 2.0) * sd / math.sqrt(n)
    return MeanInterval(n, mean, mean - half, mean + half)


def binomial_two_sided(k: int, n: int) -> float:
    """P(a count as far from n/2 as k) under Binomial(n, 1/2): the exact sign test's p-value."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 1.0
    low = min(k, n - k)
    if n <= EXACT_SIGN_TEST_MAX:  # integers divided as integers: exact to a float, where 2.0 ** n overflowed past 1023
        tail = sum(math.comb(n, i) for i in range(low + 1)) / (1 << n)
    else:
        tail = _lower_tail_of_half(low, n)
    return min(1.0, 2 * tail)


EXACT_SIGN_TEST_MAX = 2_000  # pairs up to which the sign test sums exact integers (their cost grows as n^2)


def _lower_tail_of_half(low: int, n: int) -> float:
    """P(X <= low) under Binomial(n, 1/2), low <= n/2, for large n: the terms as ratios to the largest
    (i = low), summed down until they no longer count, times that term (from log-gamma)."""
    log_top = math.lgamma(n + 1) - math.lgamma(low + 1) - math.lgamma(n - low + 1) - n * math.log(2.0)
    total, ratio = 0.0, 1.0
    for i in range(low, -1, -1):
        total += ratio
        ratio *= i / (n - i + 1)
        if ratio < 1e-17 * total:
            break
    return math.exp(log_top) * total if log_top > -745.0 else 0.0


@dataclass(frozen=True)
class Difference:
    estimate: float  # mean of b minus mean of a
    ci_low: float | None  # None: a group has fewer than 2 runs (no spread to measure), or no spread at all
    ci_high: float | None
    p_value: float | None
    df: float | None
    method: str = "Welch t-test over runs (each run's accuracy one value), 95% interval"


def welch(a: Sequence[float], b: Sequence[float]) -> Difference:
    """mean(b) - mean(a) with Welch's 95 % interval and two-sided p-value (scipy.stats.ttest_ind(b, a,
    equal_var=False)); runs are the replicates."""
    if not a or not b:
        raise ValueError("welch needs values in both groups")
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    estimate = mb - ma
    if len(a) < 2 or len(b) < 2:
        return Difference(estimate, None, None, None, None)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    se2 = va + vb
    if se2 <= 0:
        return Difference(estimate, None, None, None, None)
    df = se2 * se2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    se = math.sqrt(se2)
    half = t_quantile(df, 0.975) * se
    p = min(1.0, 2 * t_cdf(-abs(estimate / se), df))
    return Difference(estimate, estimate - half, estimate + half, p, df)


def format_p(p: float | None) -> str:
    """A p-value as people read it: `p < 0.001` below 0.001, else three decimals."""
    if p is None:
        return "p n/a"
    return "p < 0.001" if p < 0.001 else f"p = {p:.3f}"


@dataclass(frozen=True)
class SignTest:
    n: int  # pairs compared
    positive: int  # pairs where the first side is higher
    negative: int  # pairs where the second side is higher
    p_value: float


def sign_test(differences: Iterable[float]) -> SignTest:
    """Exact two-sided sign test over paired differences; zero differences count in `n`, not in the test."""
    diffs = list(differences)
    pos = sum(d > 0 for d in diffs)
    neg = sum(d < 0 for d in diffs)
    return SignTest(len(diffs), pos, neg, binomial_two_sided(pos, pos + neg))


# ------------------------------------------------------------------ the closed loop's helpers


def look_alpha(alpha: float, k: int) -> float:
    """The part of `alpha` the k-th look (1-based) may spend: alpha * 6 / (pi^2 k^2)."""
    return alpha * 6.0 / (math.pi ** 2 * max(k, 1) ** 2)


def slope_bound(points: Iterable[tuple[float, float, float]], z: float) -> tuple[float, float, float]:
    """(slope, its standard error, slope + z * se) of the weighted least-squares line through
    (x, value, variance) points (weights 1/variance). Needs two distinct x."""
    pts = [(x, y, max(v, 1e-12)) for x, y, v in points]
    w = [1.0 / v for _, _, v in pts]
    sw = sum(w)
    xbar = sum(wi * x for wi, (x, _, _) in zip(w, pts)) / sw
    ybar = sum(wi * y for wi, (_, y, _) in zip(w, pts)) / sw
    sxx = sum(wi * (x - xbar) ** 2 for wi, (x, _, _) in zip(w, pts))
    if sxx <= 0:
        raise ValueError("slope_bound needs two distinct x")
    slope = sum(wi * (x - xbar) * (y - ybar) for wi, (x, y, _) in zip(w, pts)) / sxx
    se = math.sqrt(1.0 / sxx)
    return slope, se, slope + z * se


def _gauss_legendre(m: int) -> list[tuple[float, float]]:
    """(node, weight) of the m-point Gauss-Legendre rule on [-1, 1] (Newton on P_m)."""
    out = []
    for i in range(1, m + 1):
        x = math.cos(math.pi * (i - 0.25) / (m + 0.5))
        for _ in range(100):
            p0, p1 = 1.0, x
            for j in range(2, m + 1):
                p0, p1 = p1, ((2 * j - 1) * x * p1 - (j - 1) * p0) / j
            dp = m * (x * p1 - p0) / (x * x - 1)
            step = p1 / dp
            x -= step
            if abs(step) < 1e-15:
                break
        out.append((x, 2.0 / ((1 - x * x) * dp * dp)))
    return out


_GL = _gauss_legendre(32)
_N01 = NormalDist()


@lru_cache(maxsize=1024)
def cusum_false_alarm(k: float, h: float, rounds: int) -> float:
    """P(a one-sided CUSUM S = max(0, S + x - k), S0 = 0, passes h (S > h) within `rounds`
    rounds) over independent N(0, 1) increments x: the run-length distribution by its integral
    equation (the mass of S at 0 and its density on (0, h] at 32 Gauss-Legendre nodes, stepped
    round by round; once the survival falls by the same ratio each round, its geometric tail)."""
    if k < 0 or h < 0 or rounds < 0:
        raise ValueError(f"cusum_false_alarm needs k, h, rounds >= 0 (got {k}, {h}, {rounds})")
    nodes = [(h / 2 * (x + 1), h / 2 * w) for x, w in _GL]
    to_zero = [_N01.cdf(k - y) for y, _ in nodes]  # from y to S' = 0
    from_zero = [_N01.pdf(y + k) for y, _ in nodes]  # from 0 to y
    kernel = [[w * _N01.pdf(yi - yj + k) for yj, w in nodes] for yi, _ in nodes]
    mass, density = 1.0, [0.0] * len(nodes)
    survival, ratio, step = 1.0, 0.0, 0
    while step < rounds:
        weighted = [w * f for (_, w), f in zip(nodes, density)]
        mass, density = (mass * _N01.cdf(k) + sum(wf * t for wf, t in zip(weighted, to_zero)),
                         [mass * z + sum(r * f for r, f in zip(row, density)) for z, row in zip(from_zero, kernel)])
        previous, survival = survival, mass + sum(w * f for (_, w), f in zip(nodes, density))
        step += 1
        last, ratio = ratio, survival / previous if previous > 0 else 0.0
        if step >= 20 and abs(ratio - last) < 1e-13:  # the geometric tail: the rest in one power
            survival *= ratio ** (rounds - step)
            break
    return min(1.0, max(0.0, 1.0 - survival))


@lru_cache(maxsize=256)
def cusum_horizon_limit(k: float, rounds: int, alpha: float) -> float:
    """The smallest limit h (to 1e-4) with cusum_false_alarm(k, h, rounds) <= alpha: a CUSUM of
    independent N(0, 1) rounds is cut within `rounds` rounds in at most `alpha` of runs."""
    if not 0 < alpha < 1 or rounds < 1:
        raise ValueError(f"cusum_horizon_limit needs 0 < alpha < 1 and rounds >= 1 (got {alpha}, {rounds})")
    low, high = 0.0, 1.0
    while cusum_false_alarm(k, high, rounds) > alpha:
        low, high = high, high * 2
    while high - low > 1e-4:
        mid = (low + high) / 2
        low, high = (mid, high) if cusum_false_alarm(k, mid, rounds) > alpha else (low, mid)
    return high
