"""TRL (and any HF `Trainer`): a `TrainerCallback` that reports the run and obeys the control topic.

    from areal_metrics.integrations.trl import ArealMetricsCallback
    trainer = GRPOTrainer(..., callbacks=[ArealMetricsCallback(run_id="grpo-1", tags=["grpo"])])

- `on_log`: the trainer's logs at `state.global_step`, with the fractional
  `state.epoch`; TRL's names (reward, kl, entropy, clip_ratio/region_mean,
  completions/mean_length, learning_rate, step_time...) reach the typed columns
  through the client's aliases. Evaluation logs (`eval_...`) are left to
  `on_evaluate`.
- `on_evaluate`: with `accuracy_key` among the metrics (for GRPO with a 0/1
  reward, `eval_reward`), one `log_eval` result; without it the metrics are
  added to the step's row under their `eval_` names.
- `on_step_end`: `evaluate_now` -> `control.should_evaluate` (when the trainer
  has an `eval_strategy`: an evaluation without an eval dataset would raise),
  `stop` -> `control.should_training_stop`, `set_eval_interval` ->
  `state.eval_steps`. Other commands are logged and ignored.

HF callbacks run on every process, but the values a trainer logs are already
averaged over the processes: only the main process (world rank 0) has a run,
created with `world_size=1` in `on_train_begin`. With several processes, rank
0's decision is broadcast at each step end, so every rank evaluates and stops
at the same step (a collective that would otherwise hang).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback

log = logging.getLogger("areal_metrics.integrations.trl")

EVAL_PREFIX = "eval_"
# log_eval's own parameters: an evaluation metric of that name keeps its `eval_` prefix
LOG_EVAL_PARAMETERS = frozenset({"dataset", "step", "stage", "verdicts", "accuracy", "samples", "eval_id", "replicas",
                                 "status", "error", "response_length", "reward", "latency_ms", "dataset_fingerprint"})


@dataclass(frozen=True, slots=True)
class Decision:
    """What the commands drained at one step end ask the trainer to do."""

    evaluate: bool = False
    stop: bool = False
    eval_interval: int | None = None
    ignored: tuple[str, ...] = ()


def decide(commands: Iterable[Any]) -> Decision:
    """Commands (`CommandEvent`s, oldest first) -> one decision; a later interval wins."""
    evaluate = stop = False
    interval: int | None = None
    ignored: list[str] = []
    for command in commands:
        if command.command == "evaluate_now":
            evaluate = True
        elif command.command == "stop":
            stop = True
        elif command.command == "set_eval_interval":
            interval = int(command.args["steps"])
        else:
            ignored.append(command.command)
    return Decision(evaluate, stop, interval, tuple(ignored))


def eval_result(metrics: Mapping[str, Any], accuracy_key: str) -> dict[str, Any] | None:
    """HF evaluation metrics -> `log_eval` keywords, or None when `accuracy_key` is not among them."""
    if accuracy_key not in metrics:
        return None
    out: dict[str, Any] = {"accuracy": metrics[accuracy_key]}
    named = {f"{EVAL_PREFIX}reward": "reward", f"{EVAL_PREFIX}completions/mean_length": "response_length"}
    for name, value in metrics.items():
        if name in named:
            out[named[name]] = value
        elif name == accuracy_key or name == "epoch":
            continue
        elif name == f"{EVAL_PREFIX}runtime":
            out["latency_ms"] = value * 1000.0 if isinstance(value, (int, float)) else value
        else:
            short = name.removeprefix(EVAL_PREFIX)
            out[name if short in LOG_EVAL_PARAMETERS or not short else short] = value
    return out


class ArealMetricsCallback(TrainerCallback):
    """Report a HF/TRL trainer to areal-metrics; see the module doc.

    `run`: a run of your own (from `areal_metrics.init(..., world_size=1)` on the
    main process; you finish it). Otherwise the callback creates one in
    `on_train_begin` with `init_kwargs` (run_id, config, tags, group, resume and
    any setting; `config` defaults to the training arguments) and finishes it in
    `on_train_end`.
    """

    def __init__(self, run: Any = None, *, dataset: str = "eval", accuracy_key: str = "eval_accuracy",
                 obey_commands: bool = True, **init_kwargs: Any) -> None:
        if run is not None and init_kwargs:
            raise TypeError("ArealMetricsCallback: pass either run= or init() keywords, not both")
        self.run = run
        self.dataset = dataset
        self.accuracy_key = accuracy_key
        self.obey_commands = obey_commands
        self._init_kwargs = init_kwargs
        self._owns_run = False
        self._warned: set[str] = set()

    # ------------------------------------------------------------ the run

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        if self.run is None:
            import areal_metrics

            options = {"config": args, "framework": "trl", **self._init_kwargs, "world_size": 1}
            self.run, self._owns_run = areal_metrics.init(**options), True
        if self.obey_commands:
            self.run.commands()  # starts the control consumer now; it reads from the run's start

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._owns_run and self.run is not None:
            self.run.finish()

    # ------------------------------------------------------------ logging

    def on_log(self, args: Any, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        if self.run is None or not state.is_world_process_zero or not logs:
            return
        values = {k: v for k, v in logs.items() if not str(k).startswith(EVAL_PREFIX)}
        if set(values) <= {"epoch"}:
            return  # an evaluation's logs: on_evaluate reports them
        if state.epoch is not None:
            values["epoch"] = state.epoch
        self.run.log(values, step=state.global_step)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Mapping[str, Any] | None = None,
                    **kwargs: Any) -> None:
        if self.run is None or not state.is_world_process_zero or not metrics:
            return
        result = eval_result(metrics, self.accuracy_key)
        if result is None:
            self._warn_once("no-accuracy", f"evaluation metrics have no {self.accuracy_key!r} (accuracy_key=): "
                                           "logged on the step's row instead of as an evaluation result")
            self.run.log({k: v for k, v in metrics.items() if k != "epoch"}, step=state.global_step)
            return
        self.run.log_eval(self.dataset, state.global_step, replicas=1, **result)

    # ------------------------------------------------------------ commands

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.obey_commands:
            return
        decision = decide(self.run.commands()) if self.run is not None and state.is_world_process_zero else Decision()
        if getattr(args, "world_size", 1) > 1:
            decision = _from_rank_zero(decision, args)
        if decision.ignored:
            self._warn_once("ignored", f"commands not applied by the TRL callback: {', '.join(decision.ignored)}")
        evaluates = _eval_strategy(args) != "no"
        if decision.evaluate and evaluates:
            control.should_evaluate = True
        elif decision.evaluate:
            self._warn_once("evaluate_now", "evaluate_now ignored: the trainer has eval_strategy='no' "
                                            "(set eval_strategy='steps' and an eval_dataset)")
        if decision.eval_interval is not None and _eval_strategy(args) == "steps":
            state.eval_steps = decision.eval_interval
        if decision.stop:
            control.should_training_stop = True

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)


def _eval_strategy(args: Any) -> str:
    strategy = getattr(args, "eval_strategy", "no")
    return str(getattr(strategy, "value", strategy))


def _from_rank_zero(decision: Decision, args: Any) -> Decision:
    """Rank 0's decision on every rank (one small broadcast per step while several processes train)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return decision
    flags = torch.tensor([int(decision.evaluate), int(decision.stop), decision.eval_interval or 0],
                         dtype=torch.int64, device=args.device)
    dist.broadcast(flags, src=0)
    evaluate, stop, interval = (int(x) for x in flags.tolist())
    return Decision(bool(evaluate), bool(stop), interval or None, decision.ignored)
