"""How a run tells that its policy learns: the t statistic of the accuracy's least-squares slope
over evaluation rounds (the probe and the demo's learning table read it; pure, no torch)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def ols_slope_t(xs: Sequence[float], ys: Sequence[float]) -> float:
    """t statistic of the least-squares slope of ys on xs (nan with fewer than 3 points or no spread)."""
    n = len(xs)
    if n < 3:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return float("nan")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(resid / (n - 2) / sxx)
    return slope / se if se > 0 else float("nan")
