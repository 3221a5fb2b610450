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
import math
import time
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
class TokenMark:
    """TRL's cumulative `num_tokens` at a log, with its step and monotonic time."""

    tokens: float
    step: int
    at: float


def token_columns(mark: TokenMark, num_tokens: Any, step: int, now: float) -> tuple[dict[str, float], TokenMark]:
    """TRL's cumulative `num_tokens` -> this log's `tokens` (per step, the mean over the steps since the last
    log) and `throughput` (tokens/s of wall time since the last log); and the new mark. Pure.

    A value that is not a number, or that did not grow (a resumed counter, an evaluation's log), gives nothing.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, float)) or not math.isfinite(num_tokens):
        return {}, mark
    grown, steps, seconds = num_tokens - mark.tokens, step - mark.step, now - mark.at
    new = TokenMark(float(num_tokens), step, now)
    if grown <= 0 or steps <= 0:
        return {}, new
    out = {"tokens": grown / steps}
    if seconds > 0:
        out["throughput"] = grown / seconds
    return out, new


def eval_interval(args: Any, max_steps: int | None) -> int | None:
    """The trainer's evaluation interval in steps (`eval_steps`; a float < 1 is a share of max_steps), or None
    when it evaluates on no step schedule. Pure."""
    if _eval_strategy(args) != "steps":
        return None
    steps = getattr(args, "eval_steps", None) or getattr(args, "logging_steps", None)
    if isinstance(steps, bool) or not isinstance(steps, (int, float)) or not steps > 0:
        return None
    if steps < 1:
        return max(1, math.ceil(steps * max_steps)) if max_steps and max_steps > 0 else None
    return int(steps)


def completion_samples(logs: Mapping[str, Any], seen: frozenset[int] = frozenset(),
                       limit: int = 256) -> list[dict[str, Any]]:
    """The prompts and completions a GRPOTrainer keeps for its completion log (`log_completions`), less those
    whose prompt object is in `seen` (kept before the evaluation began) -> `log_eval` samples; the reward is
    the sum of its reward functions' values. No verdict: the evaluation's accuracy stays TRL's. Pure."""
    prompts, completions = list(logs.get("prompt") or ()), list(logs.get("completion") or ())
    rewards = [list(values) for values in (logs.get("rewards") or {}).values()]
    out: list[dict[str, Any]] = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if id(prompt) in seen:
            continue
        record: dict[str, Any] = {"prompt": _text(prompt), "response": _text(completion)}
        values = [v[i] for v in rewards if i < len(v) and isinstance(v[i], (int, float)) and math.isfinite(v[i])]
        if values:
            record["reward"] = float(sum(values))
        out.append(record)
    return out[-limit:]


def _text(value: Any) -> str:
    """A prompt or completion: a string, or a conversation (list of {role, content}) as its contents."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(str(m.get("content", m)) if isinstance(m, Mapping) else str(m) for m in value)
    return str(value)


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
                 obey_commands: bool = True, trainer: Any = None, **init_kwargs: Any) -> None:
        if run is not None and init_kwargs:
            raise TypeError("ArealMetricsCallback: pass either run= or init() keywords, not both")
        self.run = run
        self.dataset = dataset
        self.accuracy_key = accuracy_key
        self.obey_commands = obey_commands
        self.trainer = trainer
        self._init_kwargs = init_kwargs
        self._owns_run = False
        self._warned: set[str] = set()
        self._tokens = TokenMark(0.0, 0, time.monotonic())
        self._before_eval: list[Any] = []  # the completions TRL kept before an evaluation (references)

    def attach(self, trainer: Any) -> ArealMetricsCallback:
        """Add this callback to `trainer` and read what it keeps of its completions (TRL's `log_completions`)."""
        self.trainer = trainer
        if self not in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
            trainer.add_callback(self)
        return self

    # ------------------------------------------------------------ the run

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        self._tokens = TokenMark(float(getattr(state, "num_input_tokens_seen", 0) or 0), state.global_step,
                                 time.monotonic())
        if self.run is None:
            import areal_metrics

            options = {"config": args, "framework": "trl", **self._init_kwargs, "world_size": 1}
            interval = eval_interval(args, getattr(state, "max_steps", None))
            if interval is not None:  # the worker's base interval: the user's, never its default
                options["config"] = {"eval_interval_steps": interval, **_as_config(options["config"])}
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
        if "num_tokens" in values and not {"tokens", "throughput"} & set(values):
            counted, self._tokens = token_columns(self._tokens, values["num_tokens"], state.global_step,
                                                  time.monotonic())
            values.update(counted)
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
        kept = self._completion_log()
        if kept is not None and "samples" not in result:
            samples = completion_samples(kept, frozenset(map(id, self._before_eval)))
            if samples:
                result["samples"] = samples  # the eval event's samples: rows of `generations`
        self._before_eval = []
        self.run.log_eval(self.dataset, state.global_step, replicas=1, **result)

    # ------------------------------------------------------------ commands

    def _completion_log(self) -> Mapping[str, Any] | None:
        """What an attached GRPOTrainer keeps of its completions, when it logs them (`log_completions`)."""
        kept = getattr(self.trainer, "_logs", None) if getattr(self.trainer, "log_completions", False) else None
        return kept if isinstance(kept, Mapping) else None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        kept = self._completion_log() if state.is_world_process_zero else None
        if kept is not None:  # an evaluation may follow this step: its completions are the ones not held here
            self._before_eval = list(kept.get("prompt") or ())
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


def _as_config(config: Any) -> dict[str, Any]:
    """The run's config as a dict: HF's TrainingArguments by their `to_dict()`."""
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else {"value": config}


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
