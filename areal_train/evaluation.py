"""Evaluation rounds: greedy answers to a fixed, shared set of problems, one verdict each.

Every rank evaluates the same problems in the same order (rank 0 built them
and broadcast them), so the verdict lists line up sample by sample for the
cross-node majority vote. A round is one or two stages (`quick`: the first
`quick_size` problems, then `full`), each over every dataset; each (dataset,
stage) becomes one `eval` event. An exception inside a stage becomes an event
with `status: failed` and the error; training goes on.

In `async` mode the round runs in a worker thread on a snapshot (a deep copy)
of the weights, so training continues meanwhile and the result is published
when it is done.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from areal_train.policy import Policy, encode_prompts
from areal_train.task import Problem, decode_response, verify
from producers.events import EvalEvent, Event

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageResult:
    verdicts: list[int]
    response_length: float  # mean answer tokens, the end token included

    @property
    def accuracy(self) -> float:
        return sum(self.verdicts) / len(self.verdicts) if self.verdicts else 0.0


@torch.no_grad()
def evaluate_problems(policy: Policy, problems: list[Problem], max_len: int, device: torch.device,
                      batch: int = 512) -> StageResult:
    """Greedy answers, verdicts in the order of `problems`."""
    verdicts: list[int] = []
    lengths = 0.0
    for start in range(0, len(problems), batch):
        chunk = problems[start:start + batch]
        rollout = policy.generate(encode_prompts(chunk, device), max_len, greedy=True)
        for problem, actions in zip(chunk, rollout.actions.tolist()):
            verdicts.append(int(verify(problem, decode_response(actions))))
        lengths += float(rollout.mask.sum())
    return StageResult(verdicts, lengths / max(len(problems), 1))


def eval_id(run_id: str, step: int, dataset: str, stage: str) -> str:
    """The round's id: the same on every rank, since all evaluate at the same step."""
    return f"{run_id}:{step}:{dataset}:{stage}"


@dataclass
class Evaluator:
    """Runs rounds (inline or in a thread) and publishes one event per dataset and stage."""

    publish: Callable[[Event], None]
    run_id: str
    node: str
    rank: int
    replicas: int
    datasets: dict[str, list[Problem]]
    max_len: int
    device: torch.device
    two_stage: bool = True
    quick_size: int = 16
    asynchronous: bool = False
    fail_at_steps: tuple[int, ...] = ()
    fail_rounds: tuple[int, ...] = ()  # 1 = the first round
    dissent: bool = False  # flip every fourth verdict: a faulty replica, for demonstrations

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval") if self.asynchronous else None
        self._pending: list[Future[list[EvalEvent]]] = []
        self.rounds = 0

    def evaluate(self, policy: Policy, step: int) -> None:
        self.rounds += 1
        if self._pool is None:
            self._round(policy, step, self.rounds)
            return
        snapshot = copy.deepcopy(policy).eval()  # training keeps changing `policy`
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(self._round, snapshot, step, self.rounds))

    def close(self, timeout: float | None = None) -> None:
        """Wait for asynchronous rounds still running, so their results are published."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _round(self, policy: Policy, step: int, round_no: int) -> list[EvalEvent]:
        events = []
        stages = ("quick", "full") if self.two_stage else ("full",)
        for stage in stages:
            for dataset, problems in self.datasets.items():
                chosen = problems[: self.quick_size] if stage == "quick" else problems
                events.append(self._stage(policy, step, round_no, dataset, stage, chosen))
                self.publish(events[-1])
        return events

    def _stage(self, policy: Policy, step: int, round_no: int, dataset: str, stage: str,
               problems: list[Problem]) -> EvalEvent:
        started = time.perf_counter()
        common = dict(run_id=self.run_id, node=self.node, rank=self.rank, eval_id=eval_id(self.run_id, step, dataset, stage),
                      step=step, dataset=dataset, stage=stage, replicas=self.replicas)
        try:
            if step in self.fail_at_steps or round_no in self.fail_rounds:
                raise RuntimeError(f"injected evaluation failure at step {step} (round {round_no})")
            result = evaluate_problems(policy, problems, self.max_len, self.device)
            verdicts = result.verdicts
            if self.dissent:
                verdicts = [1 - v if i % 4 == 0 else v for i, v in enumerate(verdicts)]
            accuracy = sum(verdicts) / len(verdicts) if verdicts else 0.0
            return EvalEvent(**common, status="ok", accuracy=accuracy, reward=accuracy,
                             response_length=result.response_length, n_samples=len(verdicts), verdicts=verdicts,
                             latency_ms=(time.perf_counter() - started) * 1000)
        except Exception as exc:  # an evaluation bug must not end the training run
            log.warning("evaluation of %s/%s at step %d failed: %s", dataset, stage, step, exc)
            return EvalEvent(**common, status="failed", error=f"{type(exc).__name__}: {exc}"[:4096],
                             n_samples=len(problems), latency_ms=(time.perf_counter() - started) * 1000)
