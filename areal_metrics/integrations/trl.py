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
- `on_step_end`: the client's `CommandApplier` over the trainer's optimizer and
  LR scheduler (HF passes both to callbacks) applies what is due before the next
  update: `scale_lr` from its `from_step` on, composed with HF's schedule (the
  lr logged for step s is the lr update s used: the factor shows from `from_step`
  on); its `restore_step` from the weights kept at the last `keep_rounds`
  evaluations (host memory; cheap with LoRA), else from the newest
  `checkpoint-N` of `output_dir` with N <= the step (`save_steps`), else the
  factor alone and a warning saying why; weights put back are evaluated at once
  (when the trainer has an `eval_strategy`), before the next update. `evaluate_now` ->
  `control.should_evaluate` (when the trainer has an `eval_strategy`: an
  evaluation without an eval dataset would raise), `stop` ->
  `control.should_training_stop`, `set_eval_interval` -> `state.eval_steps`;
  each command is acknowledged (applied, or ignored and why) on the run.

HF callbacks run on every process, but the values a trainer logs are already
averaged over the processes: only the main process (world rank 0) has a run,
created with `world_size=1` in `on_train_begin`. With several processes, rank
0's commands are broadcast at each step end (the applier's), so every rank
scales, evaluates and stops at the same step (a collective that would
otherwise hang).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback

from areal_metrics.producers.contract.field_rules import SAMPLES_MAX
from areal_metrics.producers.client.trainer_control import LR_MIN_FACTOR, CommandApplier, bounded_factor

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
                       limit: int = SAMPLES_MAX) -> list[dict[str, Any]]:
    """The prompts and completions a GRPOTrainer keeps for its completion log (`log_completions`), less those
    whose prompt object is in `seen` (kept before the evaluation began) -> `log_eval` samples; the reward is
    the sum of its reward functions' values. No verdict: the evaluation's accuracy stays TRL's. The last
    `limit`: an eval event holds SAMPLES_MAX (256 here made `log_eval` cut them, with a warning, every
    evaluation). Pure."""
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
                 obey_commands: bool = True, trainer: Any = None, keep_rounds: int = 0,
                 lr_min_factor: float = LR_MIN_FACTOR, **init_kwargs: Any) -> None:
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
        self.keep_rounds = keep_rounds
        self.lr_min_factor = lr_min_factor
        self.applier: CommandApplier | None = None  # built at the first step end (the trainer's optimizer)
        self._early: list[Any] = []
        self._begin_step = 0

    def attach(self, trainer: Any) -> ArealMetricsCallback:
        """Add this callback to `trainer` and read what it keeps of its completions (TRL's `log_completions`)."""
        self.trainer = trainer
        if self not in getattr(getattr(trainer, "callback_handler", None), "callbacks", ()):
            trainer.add_callback(self)
        return self

    # ------------------------------------------------------------ the run

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._begin_step = state.global_step  # a resumed training's: the checkpoint's step
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
        if self.obey_commands:  # starts the control consumer now (it reads from the run's start), and keeps
            self._early = list(self.run.commands())  # what already arrived for the first step end

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
        if self.applier is not None:  # every rank: the weights of an evaluated round, for a rollback
            self.applier.keep(state.global_step)
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
        applier = self._applier(args, kwargs)
        if applier is None:
            return
        # the boundary before update global_step + 1: its lr (HF logs the lr an update used) is the scaled one
        due = applier.at_step(state.global_step + 1)
        # evaluate_now; and weights a rollback put back, evaluated before any update at the new rate (as the
        # reference trainer does): the loop and the run's readers see what the rollback brought back
        if due.evaluate or (due.restored_step is not None and _eval_strategy(args) != "no"):
            control.should_evaluate = True
        if due.eval_interval is not None and _eval_strategy(args) == "steps":
            state.eval_steps = due.eval_interval
        if due.stop:
            control.should_training_stop = True

    def _applier(self, args: Any, kwargs: Mapping[str, Any]) -> CommandApplier | None:
        """The applier over the trainer's optimizer and scheduler (HF passes them to every callback)."""
        if self.applier is None and kwargs.get("optimizer") is not None:
            ignore = {}
            if _eval_strategy(args) == "no":
                ignore["evaluate_now"] = ("the trainer has eval_strategy='no' (set eval_strategy='steps' and an "
                                          "eval_dataset)")
            if _eval_strategy(args) != "steps":
                ignore["set_eval_interval"] = "the trainer evaluates on no step schedule (eval_strategy != 'steps')"
            self.applier = CommandApplier(
                self.run, kwargs["optimizer"],
                kwargs.get("lr_scheduler"), model=kwargs.get("model"), keep_rounds=self.keep_rounds,
                restore=lambda step: restore_checkpoint(args, kwargs.get("model"), kwargs["optimizer"], step),
                lr_min_factor=self.lr_min_factor, ignore=ignore)
            self.applier.submit(self._early)
            self._early = []
            saved = _saved_state(args, self._begin_step)
            if saved is not None:  # a resumed training: the commands applied and waiting, the factor
                self.applier.load_state_dict(saved)
            elif self._begin_step:  # resumed from a checkpoint this callback did not save beside (elsewhere)
                factor = scaled_factor(args, kwargs.get("lr_scheduler"), self.lr_min_factor)
                if factor is not None:  # HF restored the scaled lrs: the next cut is bounded from there
                    self.applier.factor = factor
                self._warn_once("no-command-state", (
                    f"resumed at step {self._begin_step}, but {COMMANDS_FILE} is not in {args.output_dir}/checkpoint-"
                    f"{self._begin_step} (a checkpoint from elsewhere?): the lr factor is read from the restored "
                    f"schedule (x{self.applier.factor:g}); the commands waiting at that checkpoint, and those after "
                    "it, are not applied again (resume from a checkpoint of this output_dir for that)"))
        return self.applier

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The applier's state beside HF's checkpoint (`checkpoint-N/areal_metrics_commands.json`): a training
        resumed from it (whose optimizer and scheduler hold the scaled lrs) neither applies a command again
        nor forgets one waiting for its step."""
        # every process HF saves the checkpoint from (one per node with save_on_each_node): each rank holds the
        # same state (the same commands, broadcast), and a node without it would resume without the handled ids
        if self.applier is None or not getattr(args, "should_save", state.is_world_process_zero):
            return
        import json
        from pathlib import Path

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if folder.is_dir():
            (folder / COMMANDS_FILE).write_text(json.dumps(self.applier.state_dict()))

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


COMMANDS_FILE = "areal_metrics_commands.json"


def _saved_state(args: Any, step: int) -> dict[str, Any] | None:
    """The applier's state saved with the checkpoint of `step` (the one this training resumed from), or None."""
    import json
    from pathlib import Path

    if not step or not getattr(args, "output_dir", None):
        return None
    path = Path(args.output_dir) / f"checkpoint-{step}" / COMMANDS_FILE
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def scaled_factor(args: Any, scheduler: Any, lr_min_factor: float = LR_MIN_FACTOR) -> float | None:
    """The cumulative lr factor a restored schedule holds: its first base lr over the trainer's learning rate
    (a `scale_lr` scales the schedule's base lrs, which HF's checkpoint keeps), within [lr_min_factor, 1];
    None when the schedule has no base lrs to read."""
    base = getattr(scheduler, "base_lrs", None)
    lr = getattr(args, "learning_rate", None)
    if not base or not isinstance(lr, (int, float)) or lr <= 0:
        return None
    return bounded_factor(1.0, float(base[0]) / float(lr), lr_min_factor)


def newest_checkpoint(output_dir: Any, step: int) -> Any:
    """The newest `checkpoint-N` folder of `output_dir` with N <= step (HF's save_steps), or None."""
    from pathlib import Path

    found = []
    for path in Path(output_dir).glob("checkpoint-*") if output_dir else ():
        suffix = path.name.removeprefix("checkpoint-")
        if suffix.isdigit() and int(suffix) <= step and path.is_dir():
            found.append((int(suffix), path))
    return max(found)[1] if found else None


def _load_whole(model: Any, saved: dict[str, Any], name: str) -> str | None:
    """Load `saved` into `model` only when it holds every weight of it, no other and of the same shapes; else
    why not, with nothing loaded. (`load_state_dict(strict=False)` copies every key that matches before it
    reports the others: a checkpoint in another layout, e.g. an MoE's experts as save_pretrained writes them,
    rolled back part of the model and said it had not.) A weight tied to a saved one (an lm_head tied to
    the embeddings, which save_pretrained leaves out) counts as saved."""
    current = model.state_dict()
    unexpected = [k for k in saved if k not in current]
    reshaped = [k for k in saved if k in current and tuple(saved[k].shape) != tuple(current[k].shape)]
    loaded = {current[k].data_ptr() for k in saved if k in current}
    missing = [k for k, v in current.items() if k not in saved and v.data_ptr() not in loaded]
    if unexpected or reshaped or missing:
        found = "; ".join(f"{what} {keys[:3]}" for what, keys in (("not in the model:", unexpected),
                          ("of another shape:", reshaped), ("missing:", missing)) if keys)
        return f"{name} does not match the model ({found}): nothing restored"
    model.load_state_dict(saved, strict=False)  # strict: the tied weights are not in `saved`
    return None


def restore_checkpoint(args: Any, model: Any, optimizer: Any, step: int) -> int | str:
    """Put back the weights (and the optimizer's state) of the newest checkpoint at or before `step`:
    `model.safetensors` (or `adapter_model.safetensors` with PEFT, `pytorch_model.bin`) and `optimizer.pt`
    of HF's `checkpoint-N`; the lrs stay the current ones. N when restored, else why not."""
    import torch

    if model is None:
        return "the trainer gave the callback no model"
    folder = newest_checkpoint(getattr(args, "output_dir", None), step)
    if folder is None:
        return (f"no checkpoint at or before step {step} in {getattr(args, 'output_dir', None)} "
                "(save_strategy='steps' with save_steps, or keep_rounds= to keep evaluated rounds in memory)")
    if (folder / "model.safetensors").exists():
        from safetensors.torch import load_file

        refused = _load_whole(model, load_file(str(folder / "model.safetensors")), f"{folder.name}/model.safetensors")
        if refused is not None:
            return refused
    elif (folder / "adapter_model.safetensors").exists():
        # optional: a LoRA run has peft installed
        from peft import set_peft_model_state_dict  # pyright: ignore[reportMissingImports]
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(str(folder / "adapter_model.safetensors")))
    elif (folder / "pytorch_model.bin").exists():
        refused = _load_whole(model, torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True),
                              f"{folder.name}/pytorch_model.bin")
        if refused is not None:
            return refused
    else:
        return f"{folder.name} holds no model weights this callback reads (sharded or DeepSpeed checkpoint)"
    if (folder / "optimizer.pt").exists():
        inner = getattr(optimizer, "optimizer", optimizer)
        saved = torch.load(folder / "optimizer.pt", map_location="cpu", weights_only=True)
        inner.load_state_dict({"state": saved["state"], "param_groups": inner.state_dict()["param_groups"]})
    log.info("rollback to step %d: the weights of %s restored", step, folder)
    return int(folder.name.removeprefix("checkpoint-"))
