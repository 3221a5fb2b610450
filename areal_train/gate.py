"""The two-stage gate: does the quick stage call for the full one? Pure (no torch).

The quick set is the first `quick_size` prompts of the full set, every sample
with its own noise seed, so two rounds' quick verdicts are paired sample by
sample: a sample's verdict changes only when the policy's answer to it changed.
The gate is the exact two-sided sign test on the per-prompt change in right
answers (k samples of a prompt move together, so the prompt is the unit)
between this round and the round of the last full stage; it calls for the full
stage when p < `alpha`. When the policy's answers changed but no prompt's chance
of a right answer did, a prompt is as likely to gain as to lose and the exact
test calls for a full stage in at most `alpha` of such rounds: its stated
false-positive rate (tests/test_train_two_stage.py measures it by simulation).

A skip never hides a drop: the full stage is skipped only when the quick stage
shows that accuracy did not fall by `drop_margin` or more (a one-sided
non-inferiority test: the lower `1 - alpha` bound of the mean per-prompt change
in the share of right answers, a paired t over the quick prompts, lies above
-`drop_margin`; with fewer than 11 quick prompts the full stage always runs).
A drop of that size is then sent on to the full stage, and the closed loop that
reads it, in at least 1 - alpha of rounds (the t is exact for
normal changes; the simulation measures it for 0/1 verdicts). The full stage
also runs when forced (first round, last round) or overdue (`max_skipped` skips
in a row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from areal_metrics.producers.contract.statistics import binomial_two_sided, t_quantile


def prompt_changes(before: Sequence[int], now: Sequence[int], k: int) -> list[int]:
    """Per prompt: right answers now minus before (verdicts in sample order, k per prompt)."""
    if len(before) != len(now):
        raise ValueError(f"paired verdicts of different lengths ({len(before)} and {len(now)})")
    k = max(k, 1)
    return [sum(now[i:i + k]) - sum(before[i:i + k]) for i in range(0, len(now), k)]


MIN_PROMPTS = 11  # a skip needs at least this many quick prompts (10 degrees of freedom)


def drop_bound(changes: Sequence[int], k: int, alpha: float) -> float:
    """The lower one-sided `1 - alpha` bound of the mean per-prompt change in the share of right answers."""
    shares = [c / max(k, 1) for c in changes]
    g = len(shares)
    if g < MIN_PROMPTS:
        return -1.0  # too few prompts to show a change small: the full stage runs
    mean = sum(shares) / g
    sd = math.sqrt(sum((x - mean) ** 2 for x in shares) / (g - 1))
    return mean - t_quantile(g - 1, 1 - alpha) * sd / math.sqrt(g)


@dataclass(frozen=True)
class StageMemory:
    verdicts_at_full: tuple[int, ...] | None = None  # the quick stage's verdicts when the full stage last ran
    skipped: int = 0  # full stages skipped since


@dataclass(frozen=True)
class TwoStage:
    alpha: float = 0.05  # the gate's false-positive rate per round (see the module docstring)
    max_skipped: int = 3  # the full stage is overdue after this many skips
    drop_margin: float = 0.15  # a skip needs the quick stage to show that accuracy fell by less than this

    def decide(self, memory: StageMemory, verdicts: Sequence[int], k: int, forced: str | None) -> tuple[bool, str]:
        """(run the full stage now?, why) from this round's quick verdicts (k samples per prompt)."""
        if forced:
            return True, forced
        before = memory.verdicts_at_full
        if before is None or len(before) != len(verdicts):
            return True, "first full stage"
        if memory.skipped >= self.max_skipped:
            return True, f"full stage overdue ({memory.skipped} skipped in a row)"
        changes = prompt_changes(before, verdicts, k)
        up, down = sum(c > 0 for c in changes), sum(c < 0 for c in changes)
        p = binomial_two_sided(up, up + down)
        test = (f"sign test over {len(changes)} quick prompts against the last full stage: {up} up, {down} down, "
                f"p = {p:.3f}")
        if p < self.alpha:
            return True, f"quick stage moved ({test} < alpha {self.alpha})"
        low = drop_bound(changes, k, self.alpha)
        bound = f"the mean change's lower {1 - self.alpha:.0%} bound {low:+.3f}"
        if low <= -self.drop_margin:
            return True, f"quick stage not shown to have dropped less than {self.drop_margin:g} ({test}; {bound})"
        return False, f"quick stage did not move ({test} >= alpha {self.alpha}; {bound} > -{self.drop_margin:g})"

    @staticmethod
    def remember(memory: StageMemory, verdicts: Sequence[int], ran: bool) -> StageMemory:
        return StageMemory(tuple(verdicts), 0) if ran else replace(memory, skipped=memory.skipped + 1)
