"""What the trainer reports, through the public client only (`areal_metrics.producers.client.run`, `areal_metrics.init`).

The trainer talks to a `RunLike`: the `Run` that `init()` returns (the
worker opens it, `open_client_run`), or `NullRun` when publishing is off.
`Reporter` turns the trainer's numbers into `Run.log` / `Run.log_eval` calls;
the client does the rest (typed columns, NaN -> null + `non_finite`, the
`run` events, delivery, the journal). Each event carries the run's `attempt`
(a resumed run opens its `Run` with the checkpoint's attempt + 1), a step also
`world_size` and `n_samples` (the episodes behind its reward: the weight when
ranks are averaged). Nothing in `areal_train` builds an event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from areal_metrics.areal_train.evaluation import Outcome
from areal_metrics.producers.contract.events import CommandEvent

FRAMEWORK = "torch"


def eval_id(run_id: str, step: int, dataset: str, stage: str) -> str:
    """The round's id: the same on every rank (all evaluate at the same step of the same attempt)."""
    return f"{run_id}:{step}:{dataset}:{stage}"  # the worker keys rounds by (eval_id, attempt)


class RunLike(Protocol):
    """The part of the client's `Run` the trainer uses."""

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None: ...
    def log_eval(self, dataset: str, step: int | None = None, **fields: Any) -> None: ...
    def commands(self) -> list[CommandEvent]: ...
    def finish(self, status: str | None = None, exit_code: int | None = None) -> None: ...


@dataclass(frozen=True)
class RunSpec:
    """What the trainer knows once its session is open: enough to start (or resume) the run."""

    run_id: str
    rank: int
    world_size: int
    attempt: int
    node: str
    config: Mapping[str, Any]
    tags: tuple[str, ...]
    group: str | None


class NullRun:
    """Publishing off: every call is accepted and dropped."""

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        pass

    def log_eval(self, dataset: str, step: int | None = None, **fields: Any) -> None:
        pass

    def commands(self) -> list[CommandEvent]:
        return []

    def finish(self, status: str | None = None, exit_code: int | None = None) -> None:
        pass


def open_client_run(spec: RunSpec, **settings: Any) -> RunLike:
    """The public client's run for this rank (the attempt is the trainer's: its checkpoint decides)."""
    from areal_metrics.producers.client.run import init

    return init(spec.run_id, config=dict(spec.config), tags=spec.tags, group=spec.group, rank=spec.rank,
                world_size=spec.world_size, attempt=spec.attempt, node=spec.node, framework=FRAMEWORK, **settings)


class Reporter:
    def __init__(self, run: RunLike, run_id: str) -> None:
        self.run, self.run_id = run, run_id

    def step(self, step: int, epoch: float, n_samples: int, fields: Mapping[str, float | int | None],
             metrics: Mapping[str, float]) -> None:
        """One step: the typed fields (None skipped, NaN named by the client) and the other metrics."""
        self.run.log({**metrics, **fields, "epoch": max(epoch, 0.0), "n_samples": n_samples}, step=step)

    def evaluation(self, outcome: Outcome) -> None:
        common: dict[str, Any] = dict(
            stage=outcome.stage, eval_id=eval_id(self.run_id, outcome.step, outcome.dataset, outcome.stage),
            status=outcome.status, dataset_fingerprint=outcome.fingerprint, latency_ms=outcome.latency_ms)
        result = outcome.result
        if outcome.status == "ok" and result is not None:
            self.run.log_eval(outcome.dataset, outcome.step, **common, accuracy=result.accuracy,
                              reward=result.accuracy, response_length=result.response_length,
                              verdicts=list(result.verdicts), sample_ids=list(result.sample_ids),
                              replicas=result.replicas, shard_nodes=result.shard_nodes, samples=list(result.samples),
                              **result.metrics)
        else:
            layout = {"replicas": outcome.replicas, "shard_nodes": outcome.shard_nodes} if outcome.replicas else {}
            self.run.log_eval(outcome.dataset, outcome.step, **common, error=(outcome.error or outcome.status)[:4096],
                              **layout)


@dataclass
class Logged:
    """One `log` call a `RecordedRun` kept: the values as the trainer handed them, and when."""

    step: int
    values: dict[str, Any]
    at: float  # time.perf_counter() of the call


class RecordedRun(NullRun):
    """Keeps what the trainer logs in memory: for the checks and benchmarks that run without a broker."""

    def __init__(self) -> None:
        self.steps: list[Logged] = []
        self.evals: list[dict[str, Any]] = []
        self.status: str | None = None

    def log(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        import time

        self.steps.append(Logged(len(self.steps) if step is None else step, dict(metrics), time.perf_counter()))

    def log_eval(self, dataset: str, step: int | None = None, **fields: Any) -> None:
        self.evals.append({"dataset": dataset, "step": step, **fields})

    def finish(self, status: str | None = None, exit_code: int | None = None) -> None:
        self.status = status or "finished"
