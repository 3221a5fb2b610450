"""The statistics the vote and the closed loop share: intervals, effective sample size, tests.

Pure and dependency-free (the standard library's NormalDist).

- `wilson(p, n, z)`: the Wilson score interval of a proportion `p` observed on `n` (possibly
  effective, fractional) independent samples, at normal quantile `z`.
- `effective_n(outcomes)`: the Kish effective sample size of a mean over clustered 0/1
  outcomes (several samples of one prompt are not independent). From the cluster-robust
  (sandwich) variance of the mean, `p(1-p)/var`, within [1, n]: never more than the number
  of samples, so the interval is never narrower than the plain Wilson one.
- `look_alpha(alpha, k)`: the share of `alpha` spent at the k-th look of a run,
  alpha * 6 / (pi^2 k^2). The shares sum to alpha over any number of looks, so a rule that
  tests at level look_alpha(alpha, k) at its k-th look keeps its false-alarm rate over the
  whole run at or below alpha (a union bound: no assumption on how many rounds a run has).
- `slope_bound(points, z)`: the weighted least-squares slope of (x, value, variance) points
  and its upper bound at `z` standard errors.
- `t_cdf(t, df)`, `t_quantile(df, q)`: Student's t (the regularized incomplete beta, inverted);
  the same functions, by name and signature, as the statistics module of the stats work
  (producers/contract/statistics.py), which replaces these at the merge.
- `cusum_limit(k, arl)`: the decision limit h of a one-sided CUSUM of unit-variance normal
  increments with reference value k whose in-control average run length is `arl` rounds
  (Siegmund's approximation, ARL = (exp(2kb) - 2kb - 1) / (2k^2), b = h + 1.166).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from statistics import NormalDist

Z95 = NormalDist().inv_cdf(0.975)  # two-sided 95 %: 1.95996...


def z_one_sided(alpha: float) -> float:
    """The normal quantile with `alpha` above it."""
    return NormalDist().inv_cdf(1.0 - min(max(alpha, 1e-15), 0.5))


def wilson(p: float, n: float, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval; (0, 1) when there are no samples."""
    if n <= 0:
        return 0.0, 1.0
    p = min(max(p, 0.0), 1.0)
    z2n = z * z / n
    centre = (p + z2n / 2) / (1 + z2n)
    half = z * math.sqrt(p * (1 - p) / n + z2n / (4 * n)) / (1 + z2n)
    return max(0.0, centre - half), min(1.0, centre + half)


def effective_n(clusters: Mapping[int, Sequence[int]]) -> float:
    """Kish effective sample size of the mean of 0/1 outcomes grouped in clusters (prompts).

    Each cluster is one prompt's outcomes. With one outcome per cluster this is n itself
    (up to the G/(G-1) small-sample factor, which is why it is capped at n)."""
    sizes = [len(c) for c in clusters.values() if c]
    n = sum(sizes)
    g = len(sizes)
    if n == 0:
        return 0.0
    if g == n:
        return float(n)  # every prompt sampled once: independent samples
    if g < 2:
        return 1.0  # one prompt: as good as one observation
    p = sum(sum(c) for c in clusters.values()) / n
    if p <= 0.0 or p >= 1.0:
        return float(n)  # no spread to estimate a design effect from; Wilson handles the edge
    residuals = sum((sum(c) - p * len(c)) ** 2 for c in clusters.values() if c)
    var = g / (g - 1) * residuals / (n * n)
    if var <= 0:
        return float(n)
    return min(float(n), max(1.0, p * (1 - p) / var))


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


def proportion_variance(p: float, n_eff: float) -> float:
    """The variance of a proportion estimated on `n_eff` effective samples, kept off 0 at the
    edges (a round at 0 % or 100 % is not exact): p is pulled in by half a sample."""
    if n_eff <= 0:
        return 0.25
    q = min(max(p, 0.5 / n_eff), 1 - 0.5 / n_eff)
    return q * (1 - q) / n_eff


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


def _beta_regularized(a: float, b: float, x: float) -> float:
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
    tail = 0.5 * _beta_regularized(df / 2.0, 0.5, df / (df + t * t))
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
    for _ in range(200):  # bisection: t_cdf is monotone
        mid = (low + high) / 2.0
        if mid in (low, high):
            break
        if t_cdf(mid, df) < q:
            low = mid
        else:
            high = mid
    return (low + high) / 2.0


@lru_cache(maxsize=256)
def cusum_limit(k: float, arl: float) -> float:
    """The limit h of a one-sided CUSUM S = max(0, S + x - k) over N(0, 1) increments x whose
    average run length to a false alarm is `arl` rounds (Siegmund's approximation)."""
    if k <= 0 or arl <= 1:
        raise ValueError(f"cusum_limit needs k > 0 and arl > 1 (got {k}, {arl})")

    def run_length(h: float) -> float:
        b = 2 * k * (h + 1.166)
        return (math.exp(b) - b - 1) / (2 * k * k)

    low, high = 0.0, 1.0
    while run_length(high) < arl:
        low, high = high, high * 2
    for _ in range(100):
        mid = (low + high) / 2
        if run_length(mid) < arl:
            low = mid
        else:
            high = mid
    return high
