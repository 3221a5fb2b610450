"""What a policy can do, per skill and level: greedy accuracy, sampled accuracy and pass@k.

RL sharpens what sampling already finds now and then: it has something to
work with when the sampled accuracy sits well below pass@k (the right answer
is in the policy's reach, not yet its habit), and the hard set should read
lower than the in-distribution one. This table shows both, on the held-out
evaluation prompts (`task.make_eval_set`, never trained on), grouped by skill
and level. Each prompt is answered once greedily and `k` times at
temperature 1, each sample with its own seeded noise.

    areal-metrics train --diagnose [--config FILE]
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from areal_metrics.areal_train.episodes import rollout
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.task import DATASETS, VOCAB_SIZE, Problem, make_eval_set

BATCH = 256  # rows per generation batch


@dataclass(frozen=True)
class Row:
    dataset: str
    skill: str  # "all" for a dataset's total
    level: int | None  # None for every level
    n_prompts: int
    greedy: float
    sampled: float  # mean over all k samples of every prompt
    sampled_se: float  # prompt-clustered standard error of `sampled`
    pass_at_k: float


@dataclass(frozen=True)
class Verdicts:
    problem: Problem
    greedy: int
    samples: tuple[int, ...]


def answer_all(policy: Policy, problems: Sequence[Problem], k: int, attempt_len: int, seed: int,
               device: torch.device | str = "cpu") -> list[Verdicts]:
    """Each problem answered greedily once and `k` times sampled (one attempt each)."""
    policy.eval()
    generator = torch.Generator().manual_seed(seed)
    greedy: list[int] = []
    sampled: list[int] = []
    for first in range(0, len(problems), BATCH):
        chunk = list(problems[first:first + BATCH])
        greedy += [g[0].verdict for g in rollout(policy, chunk, attempt_len=attempt_len, device=device).grades]
    rows = [p for p in problems for _ in range(k)]
    for first in range(0, len(rows), BATCH):
        chunk = rows[first:first + BATCH]
        noise = torch.rand(len(chunk), attempt_len + 1, VOCAB_SIZE, generator=generator).to(device)
        sampled += [g[0].verdict for g in rollout(policy, chunk, attempt_len=attempt_len, noise=noise,
                                                  device=device).grades]
    return [Verdicts(p, greedy[i], tuple(sampled[i * k:(i + 1) * k])) for i, p in enumerate(problems)]


def summarise(dataset: str, skill: str, level: int | None, verdicts: Sequence[Verdicts]) -> Row:
    n = len(verdicts)
    per_prompt = [sum(v.samples) / len(v.samples) for v in verdicts]
    mean = sum(per_prompt) / n
    se = math.sqrt(sum((x - mean) ** 2 for x in per_prompt) / (n - 1) / n) if n > 1 else float("nan")
    return Row(dataset, skill, level, n, sum(v.greedy for v in verdicts) / n, mean, se,
               sum(any(v.samples) for v in verdicts) / n)


def diagnose(policy: Policy, size: int = 512, k: int = 8, attempt_len: int = 28, seed: int = 0,
             device: torch.device | str = "cpu") -> list[Row]:
    """Per evaluation set: one row per (skill, level) present, then the set's total."""
    rows: list[Row] = []
    for dataset in DATASETS:
        verdicts = answer_all(policy, make_eval_set(dataset, size), k, attempt_len, seed, device)
        cells: dict[tuple[str, int], list[Verdicts]] = defaultdict(list)
        for v in verdicts:
            cells[(v.problem.skill, v.problem.level)].append(v)
        rows += [summarise(dataset, skill, level, cells[(skill, level)]) for skill, level in sorted(cells)]
        rows.append(summarise(dataset, "all", None, verdicts))
    return rows


def table(rows: Sequence[Row], k: int) -> str:
    """A Markdown table (what docs/WORKLOAD.md shows)."""
    lines = [f"| set | skill | level | prompts | greedy | sampled (± SE) | pass@{k} |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        level = "all" if r.level is None else str(r.level)
        name = f"**{r.skill}**" if r.level is None else r.skill
        lines.append(f"| {r.dataset} | {name} | {level} | {r.n_prompts} | {r.greedy:.3f} | "
                     f"{r.sampled:.3f} ± {r.sampled_se:.3f} | {r.pass_at_k:.3f} |")
    return "\n".join(lines)
