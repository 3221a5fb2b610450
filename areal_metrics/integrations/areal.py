"""AReaL: tee what its `StatsLogger` commits (`areal.utils.stats_logger`) into a run.

    from areal_metrics.integrations.areal import attach
    with PPOTrainer(config, train_dataset=..., valid_dataset=...) as trainer:
        attach(trainer.stats_logger, tags=["grpo"])
        trainer.train(workflow=..., eval_workflow=...)

AReaL's trainers commit their statistics with `commit(epoch, step, global_step,
data)`, `data` a dict or a list of dicts (one per logged step), on rank 0 only.
`attach` wraps that instance's `commit` (AReaL's own backends still run first)
and its `close` (which finishes a run that `attach` created). Each dict
becomes one `run.log` at the step AReaL itself logged it at (it keeps steps
increasing across commits), with the fractional epoch `epoch + (step + 1) /
steps_per_epoch`; AReaL's `__count` keys are left out as AReaL leaves them out.
Names such as `ppo_actor/task_reward/avg` reach the typed columns through the
client's aliases. Nothing of AReaL is imported here: any object with that
`commit` works.

AReaL's evaluations: its trainer merges the evaluation rollout's statistics into
the same commit, under the `eval-rollout` scope its workflows record in
(`workflow_context.stat_scope()`): `eval-rollout/reward` (the mean reward of the
evaluated samples) and `eval-rollout/reward__count` (how many). Each commit that
holds them also becomes one `log_eval` per dataset at the same step: the keys
`eval-rollout/<metric>` belong to the run's evaluation dataset (`eval_dataset=`,
else the basename of AReaL's `valid_dataset.path`, else `eval`), the keys
`eval-rollout/<dataset>/<metric>` (a workflow that records in a sub-scope per
dataset) to `<dataset>`. The reward is the accuracy when it lies in 0..1 (a
verifiable 0/1 reward); other metrics of the scope (e.g. `pass@4`) go to the
event's `metrics`. AReaL 1.0.4 commits aggregates only, so the consensus uses the
value rule with the sample count; `eval_verdicts=` (a callable
`(dataset, global_step) -> list of 0/1 or None`, e.g. filled by the user's eval
workflow) adds per-sample verdicts for the per-sample vote.

AReaL's learning rate: `apply_commands(trainer.actor, run)` (SPMD launch: every rank runs the
script and holds its engine's `optimizer` and `lr_scheduler`) wraps that actor's
`step_lr_scheduler`, which `PPOTrainer.train` calls once per global step after `ppo_update`:
after each call the client's `CommandApplier` applies what is due before the next update
(`scale_lr` from its `from_step` on, composed with AReaL's schedule; `restore_step` from the
evaluated rounds it keeps, `keep(step)`, or `restore=`). `evaluate_now`, `set_eval_interval`
and `stop` have no hook in AReaL's loop: they are acknowledged as ignored, with that reason.
With a single controller (`actor` is a controller whose engines live in remote workers) there
is no optimizer here: `apply_commands` returns None and says why (the worker then raises
`command_not_applied`, which is the truth).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from areal_metrics.producers.client.run_info import run_id_for
from areal_metrics.producers.client.trainer_control import LR_MIN_FACTOR, CommandApplier

log = logging.getLogger("areal_metrics.integrations.areal")

ATTACHED = "_areal_metrics_run"  # the attribute that marks a StatsLogger already attached
EVAL_SCOPE = "eval-rollout/"  # AReaL's evaluation rollout statistics (areal.infra.workflow_context.stat_scope)


def attach(stats_logger: Any, run: Any = None, *, eval_dataset: str | None = None,
           eval_verdicts: Callable[[str, int], Sequence[int] | None] | None = None, **init_kwargs: Any) -> Any:
    """Tee `stats_logger`'s commits into `run` (or a run created with `init_kwargs`); returns the run.
    Its evaluation statistics become eval events (module docstring).

    On a rank other than 0 (where AReaL's StatsLogger logs nothing) nothing is
    attached and None is returned. Attaching twice returns the first run.
    """
    if run is not None and init_kwargs:
        raise TypeError("attach(): pass either run= or init() keywords, not both")
    if getattr(stats_logger, ATTACHED, None) is not None:
        return getattr(stats_logger, ATTACHED)
    if _rank() != 0:
        return None
    owns = run is None
    if owns:
        import areal_metrics

        run = areal_metrics.init(**{**_defaults(stats_logger), **init_kwargs, "world_size": 1})
    commit, close = stats_logger.commit, getattr(stats_logger, "close", None)
    default_dataset = eval_dataset or _valid_dataset(stats_logger)

    def commit_and_log(epoch: int, step: int, global_step: int, data: Mapping[str, Any] | list) -> None:
        commit(epoch, step, global_step, data)
        items = [data] if isinstance(data, Mapping) else list(data)
        last = getattr(stats_logger, "_last_commit_step", None)  # where AReaL put the last of these items
        first = last - len(items) + 1 if isinstance(last, int) else global_step
        epoch_now = _epoch(stats_logger, epoch, step)
        for i, item in enumerate(items):
            values = {k: v for k, v in item.items() if not str(k).endswith("__count")}
            run.log({**values, "epoch": epoch_now}, step=max(first + i, 0))
            _log_evals(run, max(first + i, 0), global_step, item, default_dataset, eval_verdicts)

    def close_and_finish() -> None:
        try:
            if close is not None:
                close()
        finally:
            if owns:
                run.finish()

    stats_logger.commit = commit_and_log
    if close is not None or owns:
        stats_logger.close = close_and_finish
    setattr(stats_logger, ATTACHED, run)
    return run


def _rank() -> int:
    """This process's rank as AReaL's StatsLogger sees it (torch.distributed), else the launcher's RANK."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _defaults(stats_logger: Any) -> dict[str, Any]:
    """init() keywords from AReaL's config: name `<experiment>-<trial>` and a valid run id from it (itself, or its
    slug and a short hash), group the experiment, config the whole."""
    cfg = getattr(stats_logger, "config", None)
    experiment, trial = getattr(cfg, "experiment_name", None), getattr(cfg, "trial_name", None)
    out: dict[str, Any] = {"framework": "areal", "config": getattr(stats_logger, "exp_config", None)}
    name = f"{experiment}-{trial}" if isinstance(experiment, str) and isinstance(trial, str) else None
    if name and name.strip("-").strip():  # any names: a valid id from them, the name kept
        out["run_id"], out["name"] = run_id_for(name), name
    if isinstance(experiment, str) and experiment:
        out["group"] = experiment
    return out


def _epoch(stats_logger: Any, epoch: int, step: int) -> float:
    per_epoch = getattr(getattr(stats_logger, "ft_spec", None), "steps_per_epoch", None)
    if isinstance(per_epoch, int) and per_epoch > 0:
        return epoch + (step + 1) / per_epoch
    return float(epoch)


def evaluations(values: Mapping[str, Any], default_dataset: str) -> dict[str, dict[str, Any]]:
    """dataset -> {metric: value} of the `eval-rollout` scope of one committed dict (`__count` keys kept)."""
    out: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        name = str(key)
        if not name.startswith(EVAL_SCOPE):
            continue
        rest = name[len(EVAL_SCOPE):]
        dataset, _, metric = rest.rpartition("/")
        out.setdefault(dataset or default_dataset, {})[metric] = value
    return out


def _log_evals(run: Any, step: int, global_step: int, values: Mapping[str, Any], default_dataset: str,
               verdicts_of: Callable[[str, int], Sequence[int] | None] | None) -> None:
    for dataset, metrics in evaluations(values, default_dataset).items():
        reward = _number(metrics.pop("reward", None))
        count = _number(metrics.pop("reward__count", None))
        verdicts = verdicts_of(dataset, global_step) if verdicts_of is not None else None
        if reward is None and not verdicts:
            continue  # no result of this dataset in this commit
        extra = {k: v for k, v in metrics.items() if not k.endswith("__count") and _number(v) is not None}
        accuracy = reward if reward is not None and 0.0 <= reward <= 1.0 else None
        run.log_eval(dataset, step, accuracy=accuracy, reward=reward, verdicts=verdicts or None,
                     n_samples=int(count) if count is not None and count >= 0 else None, replicas=1, **extra)


def _number(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if x == x and abs(x) != float("inf") else None


def _valid_dataset(stats_logger: Any) -> str:
    """The basename of AReaL's `valid_dataset.path` (e.g. `gsm8k`), else `eval`."""
    path = getattr(getattr(getattr(stats_logger, "exp_config", None), "valid_dataset", None), "path", None)
    name = os.path.basename(str(path).rstrip("/")) if isinstance(path, str) and path else ""
    return name[:128] or "eval"


NO_HOOK = {
    "evaluate_now": "AReaL's PPOTrainer evaluates on its own schedule (evaluator freq_*): no hook for a command",
    "set_eval_interval": "AReaL's PPOTrainer evaluates on its own schedule (evaluator freq_*): no hook for a command",
    "stop": "AReaL's PPOTrainer loop has no hook to stop it early (stop the job yourself)",
}


def apply_commands(actor: Any, run: Any = None, *, start_step: int = 0, keep_rounds: int = 0,
                   restore: Callable[[int], Any] | None = None,
                   lr_min_factor: float = LR_MIN_FACTOR) -> CommandApplier | None:
    """Apply the control commands to an AReaL actor engine's optimizer and lr scheduler (module doc).

    `run`: the run that reads the commands (rank 0's, e.g. `attach(...)`'s; None on the other ranks:
    rank 0's commands are broadcast). `start_step`: the global step the loop starts at (a recovered
    run's). Returns the applier (its `keep(step)` keeps an evaluated round's weights for a rollback),
    or None when the actor holds no optimizer here.
    """
    optimizer = getattr(actor, "optimizer", None)
    scheduler = getattr(actor, "lr_scheduler", None)
    step_lr = getattr(actor, "step_lr_scheduler", None)
    if optimizer is None or step_lr is None:
        log.warning("apply_commands: %s holds no optimizer in this process (a single-controller launch keeps "
                    "it in remote workers): commands are not applied", type(actor).__name__)
        return None
    applier = CommandApplier(run, optimizer, scheduler, model=getattr(actor, "model", None) if keep_rounds else None,
                             keep_rounds=keep_rounds, restore=restore, lr_min_factor=lr_min_factor,
                             ignore=NO_HOOK)
    next_step = [start_step + 1]

    def step_lr_scheduler(*args: Any, **kwargs: Any) -> Any:
        out = step_lr(*args, **kwargs)
        applier.at_step(next_step[0])  # before the next global step's update: its lr is the scaled one
        next_step[0] += 1
        return out

    actor.step_lr_scheduler = step_lr_scheduler
    return applier
