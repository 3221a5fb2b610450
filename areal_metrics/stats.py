"""The statistics the readers (report, compare, demo checks) put beside a number. Pure.

- `wilson`: a 95 % interval of a proportion of `n` samples; `design_effect`
  widens it when samples come in clusters (k samples per prompt);
- `t_interval`: a 95 % interval of a mean over runs (seeds), Student's t;
- `welch`: the difference of two groups' means over runs (seeds), Welch's t interval
  and two-sided p-value (unequal variances; Welch-Satterthwaite degrees of freedom);
- `sign_test`: the exact two-sided sign test of paired differences (with one
  0/1 outcome per side it is McNemar's exact test on the discordant pairs);
- `node_majority`: one run's per-sample verdicts from its nodes' verdicts, the
  contract's vote (a strict majority of the nodes that evaluated a sample; a tie
  leaves the sample undecided).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from areal_metrics.areal_train.gate import binomial_two_sided  # the trainer's gate runs the same test
from areal_metrics.streams.core import stats as core  # t_cdf, t_quantile (the one statistics module at the merge)

Z95 = 1.959963984540054

# Student's t, two-sided 95 %, by degrees of freedom (1..30); beyond 30 the normal value is within 2 %
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def wilson(successes: float, n: float, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of successes / n; (0, 1) when n is 0. `n` may be an effective size."""
    if n <= 0:
        return 0.0, 1.0
    p = min(max(successes / n, 0.0), 1.0)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    low = 0.0 if p == 0.0 else max(0.0, centre - half)  # exact at the ends (rounding aside)
    high = 1.0 if p == 1.0 else min(1.0, centre + half)
    return low, high


def design_effect(verdicts: Sequence[int], cluster: int) -> float:
    """1 + (m - 1) * ICC for clusters of `cluster` consecutive verdicts (ICC from the data, >= 0)."""
    if cluster <= 1 or len(verdicts) < 2 * cluster:
        return 1.0
    groups = [verdicts[i:i + cluster] for i in range(0, len(verdicts) - cluster + 1, cluster)]
    p = sum(map(sum, groups)) / (len(groups) * cluster)
    if p in (0.0, 1.0):
        return 1.0
    between = sum((sum(g) / cluster - p) ** 2 for g in groups) / max(len(groups) - 1, 1)
    # one-way ANOVA estimate: var of cluster means = p(1-p)/m * (1 + (m-1) ICC)
    icc = (between * cluster / (p * (1 - p)) - 1) / (cluster - 1)
    return 1 + (cluster - 1) * min(max(icc, 0.0), 1.0)


def accuracy_interval(verdicts: Sequence[int], per_prompt: int = 1) -> tuple[float, float]:
    """Wilson interval of the verdicts' accuracy, its sample size divided by the design effect."""
    n = len(verdicts)
    deff = design_effect(verdicts, per_prompt)
    return wilson(sum(verdicts) / deff, n / deff)


def t_quantile(df: int) -> float:
    if df < 1:
        raise ValueError("a t-interval needs 2 or more values")
    return _T95[df - 1] if df <= len(_T95) else Z95


@dataclass(frozen=True)
class MeanInterval:
    n: int
    mean: float
    ci_low: float | None  # None with fewer than 2 values: no spread to measure
    ci_high: float | None


def t_interval(values: Sequence[float]) -> MeanInterval:
    """Mean and 95 % Student-t interval over independent values (one per run)."""
    if not values:
        raise ValueError("no values")
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return MeanInterval(n, mean, None, None)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(n - 1) * sd / math.sqrt(n)
    return MeanInterval(n, mean, mean - half, mean + half)


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
    half = core.t_quantile(df, 0.975) * se
    t = estimate / se
    p = min(1.0, 2 * core.t_cdf(-abs(t), df))
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


def node_majority(nodes: Iterable[Mapping[int, int]]) -> dict[int, int]:
    """sample -> verdict by a strict majority of the nodes that evaluated it; ties left out."""
    ones: dict[int, int] = {}
    seen: dict[int, int] = {}
    for verdicts in nodes:
        for sample, v in verdicts.items():
            seen[sample] = seen.get(sample, 0) + 1
            ones[sample] = ones.get(sample, 0) + (1 if v else 0)
    out = {}
    for sample, count in seen.items():
        if 2 * ones[sample] > count:
            out[sample] = 1
        elif 2 * ones[sample] < count:
            out[sample] = 0
    return out


def window_ids(length: int, offset: int | None = None, total: int | None = None) -> list[int]:
    """The sample ids of `length` verdicts: a cyclic window from `offset` of `total` (the layout older
    trainers put in `metrics`), else 0..length-1."""
    if offset is None or total is None or total < 1:
        return list(range(length))
    return [(offset + i) % total for i in range(length)]
