"""One evaluation round, the same code inline or in the evaluation process.

A round (`run_round`) has a quick stage and a full stage per dataset:

- quick: every rank evaluates the first `quick_size` prompts (k samples each),
  all of them, so every rank holds the same verdicts and comes to the same
  decision without talking to the others (`TwoStage.decide`);
- full: only when the quick stage calls for it (or it is forced: the first
  round, the last one, or overdue); sharded (`evalsets.layout`): each rank
  evaluates its window of the set; a full stage the quick stage did not call
  for is recorded as skipped, with the reason.

A stage that raises becomes a failed outcome with the error; an injected
failure (`RoundJob.fail`) raises in every stage; a dataset whose fingerprint
differs between ranks (`RoundJob.mismatch`) fails with that reason before
anything is evaluated. Outcomes go to `emit` as soon as each stage is done.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from areal_metrics.areal_train.episodes import rollout
from areal_metrics.areal_train.evalsets import EvalSet, Shard, layout
from areal_metrics.areal_train.grader import ERROR_TYPES
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.task import VOCAB_SIZE, render

SAMPLES_KEPT = 4  # generations per event, for the generations table
MAX_ROWS = 256  # rows per generation batch (a block larger than this is split at fixed points)


@dataclass(frozen=True)
class StageResult:
    verdicts: tuple[int, ...]  # in the shard's sample order
    response_length: float  # mean tokens per sample
    metrics: dict[str, float]  # pass@k, maj@k, errors.<type>, shard layout
    samples: tuple[dict[str, object], ...]
    generated_tokens: int

    @property
    def accuracy(self) -> float:
        return sum(self.verdicts) / len(self.verdicts) if self.verdicts else 0.0


@dataclass(frozen=True)
class Outcome:
    """One (dataset, stage) of a round on this rank: what the event says."""

    step: int
    dataset: str
    stage: str
    status: str  # ok | failed | skipped
    fingerprint: str
    result: StageResult | None = None
    error: str | None = None
    latency_ms: float = 0.0
    n_samples: int = 0


# ---------------------------------------------------------------- one stage


def sample_noise(evalset: EvalSet, samples: list[int], device: torch.device | str) -> torch.Tensor:
    """Each sample's own uniform noise [len(samples), attempt_len + 1, vocab], from its seed."""
    rows = []
    for s in samples:
        gen = torch.Generator().manual_seed(evalset.sample_seed(s))
        rows.append(torch.rand(evalset.attempt_len + 1, VOCAB_SIZE, generator=gen))
    return torch.stack(rows).to(device)


def evaluate_shard(policy: Policy, evalset: EvalSet, shard: Shard, device: torch.device | str,
                   pause: Callable[[float], None] | None = None) -> StageResult:
    """Sample k answers to each prompt of the shard, block by block; verdicts in window order."""
    k = evalset.k
    verdicts: list[int] = []
    answers: list[int | None] = []
    errors: Counter[str] = Counter()
    lengths, samples = 0, []
    for block in shard.blocks:
        prompts = list(block.prompts)
        for start in range(0, len(prompts) * k, MAX_ROWS):
            began = time.perf_counter()
            rows = [i * k + j for i in prompts for j in range(k)][start:start + MAX_ROWS]
            problems = [evalset.problems[s // k] for s in rows]
            episodes = rollout(policy, problems, max_turns=1, attempt_len=evalset.attempt_len,
                               temperature=evalset.temperature, noise=sample_noise(evalset, rows, device),
                               device=device)
            for problem, grades, attempts in zip(problems, episodes.grades, episodes.attempts):
                g = grades[0]
                verdicts.append(g.verdict)
                answers.append(g.answer)
                if g.error:
                    errors[g.error] += 1
                lengths += len(attempts[0])
                if len(samples) < SAMPLES_KEPT:
                    samples.append({"prompt": problem.text, "response": render(attempts[0]), "verdict": g.verdict,
                                    "reward": float(g.verdict)})
            if pause is not None:
                pause(time.perf_counter() - began)
    golds = [evalset.problems[i].answer for b in shard.blocks for i in b.prompts]
    metrics = {f"pass@{k}": pass_at_k(verdicts, k), f"maj@{k}": maj_at_k(answers, golds, k),
               "shard_offset": float(shard.offset), "shard_total": float(shard.total),
               "shard_redundancy": float(shard.redundancy), "samples_per_prompt": float(k)}
    metrics.update({f"errors.{e}": float(errors[e]) for e in ERROR_TYPES})
    return StageResult(tuple(verdicts), lengths / max(len(verdicts), 1), metrics, tuple(samples), lengths)


def pass_at_k(verdicts: list[int], k: int) -> float:
    """Share of prompts with at least one right answer among their k samples."""
    groups = [verdicts[i:i + k] for i in range(0, len(verdicts), k)]
    return sum(any(g) for g in groups) / len(groups) if groups else 0.0


def maj_at_k(answers: list[int | None], golds: list[int], k: int) -> float:
    """Share of prompts whose most frequent answer (ties: the one given first) is the right one."""
    right = 0
    for gold, start in zip(golds, range(0, len(answers), k)):
        given = [a for a in answers[start:start + k] if a is not None]
        if given:
            counts = Counter(given)
            top = max(counts.values())
            right += next(a for a in given if counts[a] == top) == gold
    return right / len(golds) if golds else 0.0


# ---------------------------------------------------------- the quick stage's say


@dataclass(frozen=True)
class StageMemory:
    quick_at_full: float | None = None  # the quick stage's accuracy when the full stage last ran
    skipped: int = 0  # full stages skipped since


@dataclass(frozen=True)
class TwoStage:
    z: float = 1.0  # a change counts when it exceeds z standard errors of the quick estimate
    max_skipped: int = 2  # the full stage is overdue after this many skips

    def decide(self, memory: StageMemory, quick: float, n: int, forced: str | None) -> tuple[bool, str]:
        """(run the full stage now?, why) from this round's quick accuracy over `n` samples."""
        if forced:
            return True, forced
        if memory.quick_at_full is None:
            return True, "first full stage"
        if memory.skipped >= self.max_skipped:
            return True, f"full stage overdue ({memory.skipped} skipped in a row)"
        p = (quick + memory.quick_at_full) / 2
        noise = self.z * math.sqrt(max(p * (1 - p), 1.0 / n) / n)
        moved = abs(quick - memory.quick_at_full)
        if moved > noise:
            return True, f"quick stage moved {moved:.3f} > noise {noise:.3f}"
        return False, (f"quick stage accuracy {quick:.3f} within noise {noise:.3f} of {memory.quick_at_full:.3f} "
                       f"at the last full stage")

    @staticmethod
    def remember(memory: StageMemory, quick: float, ran: bool) -> StageMemory:
        return StageMemory(quick, 0) if ran else replace(memory, skipped=memory.skipped + 1)


# ------------------------------------------------------------------ a round


@dataclass(frozen=True)
class RoundJob:
    step: int
    round_no: int
    rank: int
    world_size: int
    redundancy: int = 2
    quick_size: int = 16
    two_stage: bool = True
    force_full: str | None = None  # a reason the full stage runs whatever the quick stage says
    fail: bool = False  # injected: every stage raises
    dissent: bool = False  # injected: flip every fourth published verdict (a faulty replica)
    mismatch: dict[str, str] = field(default_factory=dict)  # dataset -> why its fingerprint check failed


def run_round(policy: Policy, sets: dict[str, EvalSet], job: RoundJob, memory: dict[str, StageMemory],
              rule: TwoStage, emit: Callable[[Outcome], None], device: torch.device | str,
              pause: Callable[[float], None] | None = None) -> dict[str, StageMemory]:
    """Evaluate one round on this rank; returns the quick-stage memory after it."""
    memory = dict(memory)
    for name, evalset in sets.items():
        fp = evalset.fingerprint()
        run_full, why = True, job.force_full or "single-stage evaluation"
        if job.two_stage:
            quick_set = evalset.head(job.quick_size)
            everything = layout(len(quick_set.problems), quick_set.k, job.world_size, job.world_size, job.rank)
            quick = _stage(policy, quick_set, everything, job, "quick", emit, device, pause)
            if quick.status == "ok" and quick.result is not None:
                previous = memory.get(name, StageMemory())
                run_full, why = rule.decide(previous, quick.result.accuracy, len(quick.result.verdicts), job.force_full)
                memory[name] = rule.remember(previous, quick.result.accuracy, run_full)
            else:
                why = "the quick stage failed"
        if not run_full:
            emit(Outcome(job.step, name, "full", "skipped", fp, error=f"skipped: {why}"))
            continue
        shard = layout(len(evalset.problems), evalset.k, job.world_size, job.redundancy, job.rank)
        _stage(policy, evalset, shard, job, "full", emit, device, pause)
    return memory


def _stage(policy: Policy, evalset: EvalSet, shard: Shard, job: RoundJob, stage: str,
           emit: Callable[[Outcome], None], device: torch.device | str,
           pause: Callable[[float], None] | None) -> Outcome:
    started = time.perf_counter()
    fp = evalset.fingerprint()
    n = shard.n_prompts * evalset.k
    try:
        if evalset.name in job.mismatch:
            raise RuntimeError(job.mismatch[evalset.name])
        if job.fail:
            raise RuntimeError(f"injected evaluation failure at step {job.step} (round {job.round_no})")
        result = evaluate_shard(policy, evalset, shard, device, pause)
    except Exception as exc:  # an evaluation bug must not end the training run
        outcome = Outcome(job.step, evalset.name, stage, "failed", fp, error=f"{type(exc).__name__}: {exc}"[:4096],
                          latency_ms=_ms(started), n_samples=n)
        emit(outcome)
        return outcome
    outcome = Outcome(job.step, evalset.name, stage, "ok", fp, result, latency_ms=_ms(started), n_samples=n)
    if job.dissent:  # a faulty replica publishes wrong verdicts; its own decisions stay honest
        flipped = tuple(1 - v if i % 4 == 0 else v for i, v in enumerate(result.verdicts))
        emit(replace(outcome, result=replace(result, verdicts=flipped)))
    else:
        emit(outcome)
    return outcome


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000
