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
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
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
