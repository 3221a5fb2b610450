"""One evaluation round, the same code inline or in the evaluation process.

A round (`run_round`) has a quick stage and a full stage per dataset:

- quick: every rank evaluates the first `quick_size` prompts (k samples each),
  all of them, so every rank holds the same verdicts and comes to the same
  decision without talking to the others (`gate.TwoStage.decide`, a sign test
  with a stated false-positive rate);
- full: only when the quick stage calls for it (or it is forced: the first
  round, the last one, or overdue); sharded (`evalsets.layout`): each rank
  evaluates its window of the set, reusing the quick stage's answers for the
  quick prompts in it (the quick set is the head of the full set; a sample's
  answer depends only on the weights and its own noise, so they are the same
  answers); a full stage the quick stage did not call for is recorded as
  skipped, with the reason. Each result names its `sample_ids`, `replicas`
  and `shard_nodes` (the contract's sharded round). At 2 replicas with a third
  rank, the ranks post their published verdicts to a `Board` and each rank
  adds the disputed samples of the block it adjudicates to its own result
  before the event goes out (`evalsets.adjudicator`).

A stage that raises becomes a failed outcome with the error; an injected
failure (`RoundJob.fail`) raises in every stage; a dataset whose fingerprint
differs between ranks (`RoundJob.mismatch`) fails with that reason before
anything is evaluated. Outcomes go to `emit` as soon as each stage is done.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from areal_metrics.areal_train.episodes import rollout
from areal_metrics.areal_train.evalsets import (
    EvalSet,
    Shard,
    adjudicates,
    adjudicator,
    blocks,
    covered,
    default_redundancy,
    layout,
)
from areal_metrics.areal_train.gate import StageMemory, TwoStage
from areal_metrics.areal_train.grader import ERROR_TYPES
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.task import VOCAB_SIZE, render

SHOWN_PROMPTS = 8  # prompts per dataset whose first sample the generations table shows (the same every round)
MAX_ROWS = 256  # rows per generation batch (a block larger than this is split at fixed points)


@dataclass(frozen=True)
class Answer:
    """One sample's graded answer."""

    verdict: int
    answer: int | None
    error: str | None
    length: int  # tokens of the first attempt
    response: str  # the first attempt
    solved_turn: int | None = None  # the 1-based attempt that was right (of the set's `turns`), None: none


@dataclass(frozen=True)
class StageResult:
    verdicts: tuple[int, ...]  # in `sample_ids` order
    sample_ids: tuple[int, ...]  # each verdict's sample in the set's shared order
    response_length: float  # mean tokens per sample
    metrics: dict[str, float]  # pass@k, maj@k, errors.<type>, samples_per_prompt, first_attempt_accuracy,
    # solved_within_<T>_turns (a set of T > 1 attempts)
    samples: tuple[dict[str, object], ...]
    generated_tokens: int
    replicas: int = 1  # ranks that evaluate each sample
    shard_nodes: int = 1  # ranks that share the round
    rollouts: int = 0  # samples generated for this result (reused ones not counted)
    adjudicated: int = 0  # disputed samples of another block evaluated here (at the end of the lists)

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
    replicas: int | None = None  # a failed stage's layout (an ok one's is in `result`); None: not known
    shard_nodes: int | None = None


class Board(Protocol):
    """Where the ranks of a round leave their published verdicts for the adjudicating rank."""

    def post(self, key: str, value: bytes) -> None: ...
    def fetch(self, key: str, timeout: float) -> bytes | None: ...


# ---------------------------------------------------------------- one stage


def sample_noise(evalset: EvalSet, samples: list[int], device: torch.device | str) -> torch.Tensor:
    """Each sample's own uniform noise [len(samples), turns * (attempt_len + 1), vocab], one seed per
    attempt, so the first attempt's noise does not depend on how many attempts follow."""
    rows = []
    for s in samples:
        turns = []
        for turn in range(evalset.turns):
            gen = torch.Generator().manual_seed(evalset.sample_seed(s, turn))
            turns.append(torch.rand(evalset.attempt_len + 1, VOCAB_SIZE, generator=gen))
        rows.append(torch.cat(turns))
    return torch.stack(rows).to(device)


def generate(policy: Policy, evalset: EvalSet, samples: list[int], device: torch.device | str,
             pause: Callable[[float], None] | None = None) -> dict[int, Answer]:
    """Each sample's graded answer (a row's answer depends only on the weights and its own noise)."""
    k, out = evalset.k, {}
    for start in range(0, len(samples), MAX_ROWS):
        began = time.perf_counter()
        rows = samples[start:start + MAX_ROWS]
        problems = [evalset.problems[s // k] for s in rows]
        episodes = rollout(policy, problems, max_turns=evalset.turns, attempt_len=evalset.attempt_len,
                           temperature=evalset.temperature, noise=sample_noise(evalset, rows, device), device=device)
        for s, grades, attempts, solved in zip(rows, episodes.grades, episodes.attempts, episodes.solved_turn):
            g = grades[0]
            out[s] = Answer(g.verdict, g.answer, g.error, len(attempts[0]), render(attempts[0]), solved)
        if pause is not None:
            pause(time.perf_counter() - began)
    return out


def shard_answers(policy: Policy, evalset: EvalSet, shard: Shard, device: torch.device | str,
                  pause: Callable[[float], None] | None = None,
                  known: Mapping[int, Answer] | None = None) -> tuple[list[int], dict[int, Answer], int]:
    """(the shard's samples in window order, their answers, how many were generated): samples in `known`
    (the quick stage's, same weights, so the same answers) are reused, not generated again."""
    ids = covered(shard, evalset.k)
    answers = {s: known[s] for s in ids if known and s in known}
    todo = [s for s in ids if s not in answers]
    answers.update(generate(policy, evalset, todo, device, pause))
    return ids, answers, len(todo)


def greedy_accuracy(policy: Policy, evalset: EvalSet, prompts: Sequence[int], device: torch.device | str,
                    pause: Callable[[float], None] | None = None) -> float:
    """Share of `prompts` whose greedy (argmax) first attempt is right: one answer per prompt."""
    right = 0
    for start in range(0, len(prompts), MAX_ROWS):
        began = time.perf_counter()
        problems = [evalset.problems[p] for p in prompts[start:start + MAX_ROWS]]
        episodes = rollout(policy, problems, max_turns=1, attempt_len=evalset.attempt_len, noise=None, device=device)
        right += sum(grades[0].verdict for grades in episodes.grades)
        if pause is not None:
            pause(time.perf_counter() - began)
    return right / len(prompts) if prompts else 0.0


def shown_prompts(evalset: EvalSet) -> frozenset[int]:
    """The prompts the generations table shows: a fixed choice per dataset (its name and seed), spread over
    the set, so the same prompts appear every round and on whichever rank holds them."""
    n = len(evalset.problems)
    return frozenset(random.Random(f"{evalset.name}/{evalset.seed}/{n}").sample(range(n), min(SHOWN_PROMPTS, n)))


def evaluate_shard(policy: Policy, evalset: EvalSet, shard: Shard, device: torch.device | str,
                   pause: Callable[[float], None] | None = None, shard_nodes: int = 1) -> StageResult:
    """Sample k answers to each prompt of the shard (and a greedy one); verdicts in window order."""
    ids, answers, generated = shard_answers(policy, evalset, shard, device, pause)
    greedy = greedy_accuracy(policy, evalset, prompts_of(ids, evalset.k), device, pause)
    return summarize(evalset, ids, answers, shard.redundancy, shard_nodes, generated, greedy)


def prompts_of(ids: Sequence[int], k: int) -> list[int]:
    """The prompts of sample ids, in order, each once."""
    return list(dict.fromkeys(s // k for s in ids))


def sample_record(evalset: EvalSet, sample: int, a: Answer) -> dict[str, object]:
    """One row of the generations table: the prompt, the answer given, the gold answer, the error type."""
    problem = evalset.problems[sample // evalset.k]
    return {"prompt": problem.text, "response": a.response, "verdict": a.verdict, "reward": float(a.verdict),
            "gold": str(problem.answer), "error_type": a.error or ""}


def summarize(evalset: EvalSet, ids: Sequence[int], answers: Mapping[int, Answer], replicas: int, shard_nodes: int,
              rollouts: int, greedy: float | None = None) -> StageResult:
    """The stage's result over `ids` (whole prompts, k samples each, in order); `greedy`: the greedy accuracy
    over the same prompts, when evaluated."""
    k = evalset.k
    chosen = [answers[s] for s in ids]
    verdicts = [a.verdict for a in chosen]
    errors = Counter(a.error for a in chosen if a.error)
    shown = shown_prompts(evalset)
    samples = [sample_record(evalset, s, answers[s]) for s in ids if s % k == 0 and s // k in shown]
    golds = [evalset.problems[s // k].answer for s in ids[::k]]
    metrics = {f"pass@{k}": pass_at_k(verdicts, k), f"maj@{k}": maj_at_k([a.answer for a in chosen], golds, k),
               "samples_per_prompt": float(k), "first_attempt_accuracy": sum(verdicts) / max(len(verdicts), 1)}
    if greedy is not None:
        metrics["greedy_accuracy"] = greedy
    if evalset.turns > 1:  # what the extra attempts buy, beside the first attempt's accuracy
        solved = sum(1 for a in chosen if a.solved_turn is not None and a.solved_turn <= evalset.turns)
        metrics[f"solved_within_{evalset.turns}_turns"] = solved / max(len(chosen), 1)
    metrics.update({f"errors.{e}": float(errors[e]) for e in ERROR_TYPES})
    lengths = sum(a.length for a in chosen)
    return StageResult(tuple(verdicts), tuple(ids), lengths / max(len(verdicts), 1), metrics, tuple(samples),
                       lengths, replicas, shard_nodes, rollouts)


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


# ------------------------------------------------------------------ a round

ADJUDICATION_WAIT_S = 300.0  # how long the adjudicating rank waits for a holder's verdicts (then votes without)


@dataclass(frozen=True)
class RoundJob:
    step: int
    round_no: int
    rank: int
    world_size: int
    redundancy: int | None = None  # ranks per sample of the full stage; None: `evalsets.default_redundancy`
    quick_size: int = 16
    two_stage: bool = True
    force_full: str | None = None  # a reason the full stage runs whatever the quick stage says
    fail: bool = False  # injected: every stage raises
    dissent: bool = False  # injected: a faulty replica's published verdicts (`dissent_kind`)
    dissent_kind: str = "flip"  # "flip": every fourth verdict flipped; "stuck": a grader that returns 0 for all
    mismatch: dict[str, str] = field(default_factory=dict)  # dataset -> why its fingerprint check failed

    @property
    def replicas(self) -> int:
        return min(default_redundancy(self.world_size, self.redundancy), self.world_size)


def run_round(policy: Policy, sets: dict[str, EvalSet], job: RoundJob, memory: dict[str, StageMemory],
              rule: TwoStage, emit: Callable[[Outcome], None], device: torch.device | str,
              pause: Callable[[float], None] | None = None, board: Board | None = None) -> dict[str, StageMemory]:
    """Evaluate one round on this rank; returns the quick-stage memory after it. `board`: where the ranks
    exchange the full stage's verdicts for adjudication (None: no adjudication)."""
    memory = dict(memory)
    for name, evalset in sets.items():
        fp = evalset.fingerprint()
        run_full, why = True, job.force_full or "single-stage evaluation"
        known: dict[int, Answer] = {}
        if job.two_stage:
            quick_set = evalset.head(job.quick_size)
            everything = layout(len(quick_set.problems), quick_set.k, job.world_size, job.world_size, job.rank)
            quick, known = _stage(policy, quick_set, everything, job, "quick", emit, device, pause)
            if quick.status == "ok" and quick.result is not None:
                previous = memory.get(name, StageMemory())
                honest = [known[s].verdict for s in quick.result.sample_ids]  # a faulty replica decides honestly
                run_full, why = rule.decide(previous, honest, evalset.k, job.force_full)
                memory[name] = rule.remember(previous, honest, run_full)
            else:
                why = "the quick stage failed"
        if not run_full:
            emit(Outcome(job.step, name, "full", "skipped", fp, error=f"skipped: {why}"))
            continue
        shard = layout(len(evalset.problems), evalset.k, job.world_size, job.replicas, job.rank)
        _stage(policy, evalset, shard, job, "full", emit, device, pause, known,
               board if adjudicates(job.world_size, shard.redundancy) else None)
    return memory


def _stage(policy: Policy, evalset: EvalSet, shard: Shard, job: RoundJob, stage: str,
           emit: Callable[[Outcome], None], device: torch.device | str,
           pause: Callable[[float], None] | None, known: Mapping[int, Answer] | None = None,
           board: Board | None = None) -> tuple[Outcome, dict[int, Answer]]:
    """One stage on this rank: (its outcome as emitted, the honest answers it holds)."""
    started = time.perf_counter()
    fp = evalset.fingerprint()
    n = shard.n_prompts * evalset.k
    nodes = job.world_size if shard.redundancy < job.world_size else shard.redundancy
    answers: dict[int, Answer] = {}
    try:
        if evalset.name in job.mismatch:
            raise RuntimeError(job.mismatch[evalset.name])
        if job.fail:
            raise RuntimeError(f"injected evaluation failure at step {job.step} (round {job.round_no})")
        ids, answers, generated = shard_answers(policy, evalset, shard, device, pause, known)
        greedy = greedy_accuracy(policy, evalset, prompts_of(ids, evalset.k), device, pause)
        result = summarize(evalset, ids, answers, shard.redundancy, nodes, generated, greedy)
        if job.dissent:  # a faulty replica publishes wrong verdicts; its own decisions stay honest
            result = replace(result, verdicts=_flipped(result.verdicts, job.dissent_kind))
        if board is not None:
            result = _adjudicate(policy, evalset, job, result, board, device, pause)
    except Exception as exc:  # an evaluation bug must not end the training run
        if board is not None:
            _post(board, job, evalset.name, job.rank, None)  # nobody waits for this rank's verdicts
        outcome = Outcome(job.step, evalset.name, stage, "failed", fp, error=f"{type(exc).__name__}: {exc}"[:4096],
                          latency_ms=_ms(started), n_samples=n, replicas=shard.redundancy, shard_nodes=nodes)
        emit(outcome)
        return outcome, {}
    outcome = Outcome(job.step, evalset.name, stage, "ok", fp, result, latency_ms=_ms(started),
                      n_samples=len(result.verdicts))
    emit(outcome)
    return outcome, answers


def _flipped(verdicts: Sequence[int], kind: str = "flip") -> tuple[int, ...]:
    """A faulty replica's verdicts: every fourth flipped, or (`stuck`) all 0, a systematic fault."""
    if kind == "stuck":
        return tuple(0 for _ in verdicts)
    return tuple(1 - v if i % 4 == 0 else v for i, v in enumerate(verdicts))


# ------------------------------------------------------------ adjudication


def _key(job: RoundJob, dataset: str, rank: int) -> str:
    return f"areal-eval/{job.step}/{job.round_no}/{dataset}/{rank}"


def _post(board: Board, job: RoundJob, dataset: str, rank: int, verdicts: dict[int, int] | None) -> None:
    board.post(_key(job, dataset, rank), json.dumps(verdicts).encode())


def _fetch(board: Board, job: RoundJob, dataset: str, rank: int) -> dict[int, int] | None:
    raw = board.fetch(_key(job, dataset, rank), ADJUDICATION_WAIT_S)
    data = json.loads(raw) if raw else None
    return {int(s): int(v) for s, v in data.items()} if isinstance(data, dict) else None


def disputed(block_samples: Sequence[int], a: Mapping[int, int], b: Mapping[int, int]) -> list[int]:
    """The block's samples whose two replicas published different verdicts."""
    return [s for s in block_samples if s in a and s in b and a[s] != b[s]]


def _adjudicate(policy: Policy, evalset: EvalSet, job: RoundJob, result: StageResult, board: Board,
                device: torch.device | str, pause: Callable[[float], None] | None) -> StageResult:
    """Post this rank's published verdicts; evaluate the disputed samples of the block it adjudicates and
    add them (after its own) to its result, before the round's event goes out."""
    _post(board, job, evalset.name, job.rank, dict(zip(result.sample_ids, result.verdicts)))
    block, (first, second) = adjudicator(job.rank, job.world_size)
    a, b = _fetch(board, job, evalset.name, first), _fetch(board, job, evalset.name, second)
    if a is None or b is None:
        return result  # a holder failed or is gone: its round is voted without adjudication
    part = blocks(len(evalset.problems), job.world_size)[block]
    samples = [i * evalset.k + j for i in part.prompts for j in range(evalset.k)]
    extra = disputed(samples, a, b)
    if not extra:
        return result
    answers = generate(policy, evalset, extra, device, pause)
    verdicts = tuple(answers[s].verdict for s in extra)
    if job.dissent:
        verdicts = _flipped(result.verdicts + verdicts, job.dissent_kind)[len(result.verdicts):]
    return replace(result, verdicts=result.verdicts + verdicts, sample_ids=result.sample_ids + tuple(extra),
                   rollouts=result.rollouts + len(extra), adjudicated=len(extra))


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000
