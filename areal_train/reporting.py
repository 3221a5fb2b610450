"""Everything the trainer publishes, built in one place: run, step and eval events, dead letters.

The trainer calls `Reporter`; nothing else in `areal_train` builds an event.
Each event carries the run's `attempt` (a resumed run publishes with the
checkpoint's attempt + 1), a step event also `world_size` and `n_samples`
(the episodes behind its reward: the weight when ranks are averaged). A
non-finite number becomes null and is named in `non_finite`, so a diverging
run is reported, not crashed. `publish` never blocks (the Publisher queues).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable, Mapping
from typing import Any

from areal_train.evaluation import Outcome
from producers.deadletter import rejected
from producers.events import EvalEvent, Event, RunEvent, StepEvent

FRAMEWORK = "torch"


def eval_id(run_id: str, step: int, dataset: str, stage: str) -> str:
    """The round's id: the same on every rank (all evaluate at the same step of the same attempt)."""
    return f"{run_id}:{step}:{dataset}:{stage}"  # the worker keys rounds by (eval_id, attempt)


class Reporter:
    def __init__(self, publish: Callable[[Event], None], run_id: str, node: str, rank: int, world_size: int,
                 attempt: int = 0) -> None:
        self._publish = publish
        self.run_id, self.node, self.rank, self.world_size, self.attempt = run_id, node, rank, world_size, attempt

    def _envelope(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "node": self.node, "rank": self.rank}

    def run(self, status: str, config: Mapping[str, Any], exit_code: int | None = None,
            tags: tuple[str, ...] = (), group: str | None = None) -> None:
        self._publish(RunEvent(**self._envelope(), status=status, config=dict(config), tags=tags, group=group,
                               world_size=self.world_size, host=socket.gethostname()[:256], attempt=self.attempt,
                               framework=FRAMEWORK, exit_code=exit_code))

    def step(self, step: int, epoch: float, n_samples: int, fields: Mapping[str, float | int | None],
             metrics: Mapping[str, float]) -> StepEvent:
        clean: dict[str, Any] = {}
        non_finite: list[str] = []
        for name, value in fields.items():
            if isinstance(value, float) and not math.isfinite(value):
                non_finite.append(name)
                value = None
            clean[name] = value
        kept = {}
        for name, value in metrics.items():
            if math.isfinite(value):
                kept[name] = float(value)
            else:
                non_finite.append(name)
        event = StepEvent(**self._envelope(), step=step, epoch=max(epoch, 0.0), world_size=self.world_size,
                          attempt=self.attempt, n_samples=n_samples, metrics=kept, non_finite=tuple(non_finite),
                          **clean)
        self._publish(event)
        return event

    def evaluation(self, outcome: Outcome) -> EvalEvent:
        common: dict[str, Any] = dict(
            **self._envelope(), eval_id=eval_id(self.run_id, outcome.step, outcome.dataset, outcome.stage),
            step=outcome.step, dataset=outcome.dataset, stage=outcome.stage, status=outcome.status,
            dataset_fingerprint=outcome.fingerprint, replicas=self.world_size, attempt=self.attempt,
            latency_ms=outcome.latency_ms)
        result = outcome.result
        if outcome.status == "ok" and result is not None:
            event = EvalEvent(**common, accuracy=result.accuracy, reward=result.accuracy,
                              response_length=result.response_length, n_samples=len(result.verdicts),
                              verdicts=result.verdicts, metrics=result.metrics, samples=result.samples)
        else:
            event = EvalEvent(**common, error=(outcome.error or outcome.status)[:4096],
                              n_samples=outcome.n_samples or None)
        self._publish(event)
        return event

    def dead_letter(self, raw: bytes, reason: str, topic: str, key: bytes) -> None:
        """A control message that failed validation (the control listener's)."""
        self._publish(rejected(raw, reason, topic, node=self.node, key=key))
