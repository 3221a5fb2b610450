"""Trainer configuration: a Struct of defaults that a JSON or TOML file overrides.

Each setting is declared once: its type (the annotation), its range and text (`Meta`) and its
default; `areal_metrics.producers.contract.config_fields` checks them on every path (code, a
file, `replace`), and `TrainConfig.cross_check` holds the rules between settings. A bad value
raises `ConfigError` naming the key and the file; the CLI turns it into a one-line error with
exit status 2.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from areal_metrics.areal_train.scheduler import EvalScheduler
from areal_metrics.areal_train.task import DATASETS, EVAL_EXCLUDE_SIZE
from areal_metrics.producers.contract.config_fields import Config, replaced
from areal_metrics.producers.contract.config_fields import load as load_config
from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.eval_loop import EVAL_LOOP
from areal_metrics.producers.contract.eval_loop import check as check_eval_loop


def _k(description: str, **bounds: Any) -> Meta:
    return Meta(description=description, **bounds)


class TrainConfig(Config, frozen=True):
    # optimisation (PPO with group-relative advantages by default)
    seed: Annotated[int, _k("seed of the data, the warm start and the rollouts")] = 0
    lr: Annotated[float, _k("learning rate of the parameters RL trains (rl_parameters); docs/WORKLOAD.md, "
                            "\"Learning\"", gt=0)] = 3e-2
    # The final LayerNorm sharpens the label-smoothed warm start, and the rest stays as it was taught (updates of
    # every weight from a few thousand episodes only added noise here: docs/WORKLOAD.md, "Learning")
    rl_parameters: Annotated[str, _k("the parameters RL updates: a regular expression over their names (\".\": "
                                     "all)")] = "ln_final|value_head"
    lr_min_scale: Annotated[float, _k("the floor of the lr scale that scale_lr commands multiply (six halvings)",
                                      gt=0, le=1)] = 1 / 64
    batch_prompts: Annotated[int, _k("prompts per rank and step", ge=1)] = 8
    group_size: Annotated[int, _k("episodes per prompt (the GRPO group; a group needs company)", ge=2)] = 4
    ppo_epochs: Annotated[int, _k("passes over one rollout", ge=1)] = 1
    ppo_minibatches: Annotated[int, _k("updates per pass (must divide batch_prompts x group_size); the later ones "
                                       "are off-policy, so the clip matters", ge=1)] = 2
    clip_eps: Annotated[float, _k("PPO's clip range", gt=0)] = 0.2
    entropy_coef: Annotated[float, _k("weight of the entropy bonus", ge=0)] = 0.0
    kl_coef: Annotated[float, _k("weight of k3 against the frozen warm start; 0 skips that forward (kl then "
                                 "reports old vs new)", ge=0)] = 0.0
    max_grad_norm: Annotated[float, _k("gradient clipping", gt=0)] = 1.0
    advantage: Annotated[Literal["grpo", "gae"], _k("grpo (group-relative) or gae (PPO with the value head)")] \
        = "grpo"
    gamma: Annotated[float, _k("discount (gae)", ge=0, le=1)] = 1.0
    gae_lambda: Annotated[float, _k("GAE's lambda", ge=0, le=1)] = 0.95
    value_coef: Annotated[float, _k("weight of the value loss (gae)", ge=0)] = 0.5
    temperature: Annotated[float, _k("sampling temperature of the training rollouts", gt=0)] = 1.0
    # the strategy: single or multi-turn (attempts with feedback between them)
    max_turns: Annotated[int, _k("attempts per episode, with feedback between them (mt4-grpo: 4, mt2-grpo: 2)",
                                 ge=1)] = 1
    turn_discount: Annotated[float, _k("reward of a right answer at attempt t: turn_discount ** (t - 1)",
                                       ge=0, le=1)] = 0.9
    # model and task
    d_model: Annotated[int, _k("model width (a multiple of heads)", ge=1)] = 64
    layers: Annotated[int, _k("transformer layers", ge=1)] = 2
    heads: Annotated[int, _k("attention heads", ge=1)] = 4
    warmstart_steps: Annotated[int, _k("supervised steps before RL (cached on disk, about a minute of one core); "
                                       "0: none", ge=0)] = 1200
    max_response_len: Annotated[int, _k("tokens per attempt (# , a digit and the end token at least)", ge=4)] = 28
    train_size: Annotated[int, _k("problems in one epoch", ge=1)] = 4096
    # evaluation
    eval_datasets: Annotated[tuple[str, ...], _k(f"the evaluation sets, distinct names from {', '.join(DATASETS)}",
                                                 min_length=1)] = DATASETS
    eval_size: Annotated[int, _k("prompts per dataset", ge=1, le=EVAL_EXCLUDE_SIZE)] = 128
    eval_samples: Annotated[int, _k("samples per prompt (pass@k, maj@k); 128 x 4: a prompt-clustered SE of about "
                                    "0.03", ge=1)] = 4
    eval_temperature: Annotated[float, _k("sampling temperature of the evaluation", gt=0)] = 1.0
    eval_redundancy: Annotated[int, _k("ranks per sample of the full stage; null: 3 with 3+ ranks, else all",
                                       ge=1)] | None = None
    eval_every_steps: Annotated[int, _k("an evaluation round every this many steps (null: none)", ge=1)] | None = 25
    eval_every_epochs: Annotated[int, _k("... or every this many epochs", ge=1)] | None = None
    eval_every_seconds: Annotated[float, _k("... or every this many seconds", gt=0)] | None = None
    eval_at_start: Annotated[bool, _k("a round before the first step")] = True
    eval_at_end: Annotated[bool, _k("a last round after the final step, unless that step was just evaluated")] = True
    eval_mode: Annotated[Literal["sync", "async"], _k("sync (inline) or async (an evaluation process per rank, on "
                                                      "a weight snapshot)")] = "sync"
    eval_cpu_share: Annotated[float, _k("async: the share of a core the evaluation process may use", gt=0, le=1)] \
        = 1.0
    eval_max_pending: Annotated[int, _k("async: rounds in the evaluation process at once; more are skipped",
                                        ge=1)] = 1
    eval_threads: Annotated[int, _k("torch threads of the evaluation", ge=1)] = 1
    two_stage: Annotated[bool, _k("a quick subset first; the full set only when the quick stage calls for it")] \
        = True
    quick_size: Annotated[int, _k("prompts per dataset of the quick stage (<= eval_size)", ge=1)] = 16
    eval_turns: Annotated[int, _k("attempts per evaluated sample (solved_within_<T>_turns); null: max_turns",
                                  ge=1)] | None = None
    quick_alpha: Annotated[float, _k("the quick stage's gate: a sign test's false-positive rate "
                                     "(areal_train/gate.py)", gt=0, lt=1)] = 0.05
    full_max_skipped: Annotated[int, _k("... or the full stage runs after this many skipped full stages", ge=0)] = 3
    # checkpoints (every K steps and at the end) and the run's labels
    checkpoint_every_steps: Annotated[int, _k("a checkpoint every this many steps (and at the end; null: none)",
                                              ge=1)] | None = 50
    checkpoint_every_seconds: Annotated[float, _k("... or every this many seconds", gt=0)] | None = None
    checkpoint_dir: Annotated[str, _k("where checkpoints go; null: $AREAL_HOME/checkpoints")] | None = None
    group: Annotated[str, _k("the run's group (compared runs share one); null: the strategy",
                             min_length=1, max_length=256)] | None = None
    tags: Annotated[tuple[str, ...], _k("the run's tags")] = ()
    eval_loop: Annotated[dict[str, Any], _k("the stream worker's closed loop for this run (run.config.eval_loop, "
                                            "CONTRACT.md; keys: " + ", ".join(EVAL_LOOP) +
                                            "); null: the worker's settings")] | None = None
    # runtime
    device: Annotated[Literal["auto", "cpu", "cuda"], _k("where the model runs")] = "auto"
    threads: Annotated[int, _k("torch threads per process", ge=1)] = 1
    publish: Annotated[bool, _k("send the run's events to Kafka")] = True
    # fault injection, for demonstrations of degraded mode, dissent and a broken data copy
    fail_eval_at_steps: Annotated[tuple[Annotated[int, Meta(ge=0)], ...],
                                  _k("every rank's evaluation raises at these steps")] = ()
    fail_eval_rounds: Annotated[tuple[Annotated[int, Meta(ge=1)], ...],
                                _k("... or in these rounds (1 = the first), whatever their step")] = ()
    dissent_rank: Annotated[int, _k("this rank publishes wrong verdicts (a faulty replica) ...", ge=0)] | None = None
    dissent_kind: Annotated[Literal["flip", "stuck"], _k("... flip: every fourth verdict flipped; stuck: its grader "
                                                         "returns 0 for all")] = "flip"
    corrupt_eval_rank: Annotated[int, _k("this rank's copy of the evaluation data differs (fingerprint check)",
                                         ge=0)] | None = None

    @property
    def strategy(self) -> str:
        return f"mt{self.max_turns}-{self.advantage}"

    def eval_schedule(self, now: float) -> EvalScheduler:
        """The evaluation schedule these settings ask for, from `now` (the round at the end of
        training, `eval_at_end`, is the trainer's own)."""
        return EvalScheduler(every_steps=self.eval_every_steps, every_epochs=self.eval_every_epochs,
                             every_seconds=self.eval_every_seconds, at_start=self.eval_at_start, start_time=now)

    @property
    def evaluates_on_schedule(self) -> bool:
        """Whether the run evaluates by itself (else only an `evaluate_now` command makes it)."""
        return self.eval_at_end or self.eval_schedule(0.0).will_evaluate

    def cross_check(self) -> None:
        def need(ok: bool, key: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"{key}: {rule} (got {getattr(self, key)!r})")

        need(self.d_model % self.heads == 0, "d_model", f"must be a multiple of heads ({self.heads})")
        need((self.batch_prompts * self.group_size) % self.ppo_minibatches == 0, "ppo_minibatches",
             "must divide batch_prompts * group_size")
        need(_compiles(self.rl_parameters), "rl_parameters", "must be a regular expression")
        need(all(d in DATASETS for d in self.eval_datasets) and len(set(self.eval_datasets)) == len(self.eval_datasets),
             "eval_datasets", f"must be a non-empty list of distinct names from {', '.join(DATASETS)}")
        need(self.quick_size <= self.eval_size, "quick_size", "must be <= eval_size")
        # eval_loop: checked as the stream worker checks it (producers/contract/eval_loop.py), the first refusal named
        refused = check_eval_loop(self.eval_loop)[1] if self.eval_loop is not None else []
        if refused:
            raise ConfigError(f"eval_loop.{refused[0][0]}: {refused[0][1]}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values; `eval_loop` only when set (the run event's config: absent, not null)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in msgspec.structs.asdict(self).items()
                if not (k == "eval_loop" and v is None)}

    def replace(self, **changes: Any) -> TrainConfig:
        return replaced(self, changes, "config")


def from_mapping(data: dict[str, Any], where: str = "config") -> TrainConfig:
    """Build a config from a mapping, every value checked (areal_metrics.producers.contract.config_fields)."""
    return load_config(TrainConfig, data, where)


def load(path: str | Path | None, **overrides: Any) -> TrainConfig:
    """Defaults, then the file (JSON, or TOML by its .toml suffix), then `overrides`."""
    data: dict[str, Any] = {}
    where = "config"
    if path is not None:
        path = Path(path)
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        try:
            data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: not valid {'TOML' if path.suffix == '.toml' else 'JSON'} ({exc})") from None
        except RecursionError:  # both parsers recurse per level: a file nested deeper than a config ever is
            raise ConfigError(f"{path}: nested too deeply to be a config") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: must hold an object of settings")
    data.update({k: v for k, v in overrides.items() if v is not None})
    return from_mapping(data, where)


def _compiles(pattern: str) -> bool:
    try:
        re.compile(pattern)
    except re.error:
        return False
    return True
