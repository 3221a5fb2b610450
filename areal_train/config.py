"""Trainer configuration: a dataclass of defaults that a JSON or TOML file overrides.

A bad value raises `ConfigError` naming the key and the file; the CLI turns it
into a one-line error with exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal_metrics.areal_train.scheduler import EvalScheduler
from areal_metrics.areal_train.task import DATASETS, EVAL_EXCLUDE_SIZE
from areal_metrics.producers.contract.config_fields import typed_fields
from areal_metrics.producers.contract.errors import ConfigError


@dataclass(frozen=True)
class TrainConfig:
    # optimisation (PPO with group-relative advantages by default)
    seed: int = 0
    lr: float = 3e-2  # of the parameters RL trains (rl_parameters); docs/WORKLOAD.md, "Learning"
    # The parameters RL updates (a regular expression over their names; "." for all): the final
    # LayerNorm sharpens the label-smoothed warm start, and the rest stays as it was taught (updates of
    # every weight from a few thousand episodes only added noise here: docs/WORKLOAD.md, "Learning")
    rl_parameters: str = "ln_final|value_head"
    lr_min_scale: float = 1 / 64  # the floor of the lr scale that scale_lr commands multiply (six halvings)
    batch_prompts: int = 8  # prompts per rank and step
    group_size: int = 4  # episodes per prompt (the GRPO group)
    ppo_epochs: int = 1  # passes over one rollout
    ppo_minibatches: int = 2  # updates per pass; the later ones are off-policy, so the clip matters
    clip_eps: float = 0.2
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # k3 against the frozen warm start; 0 skips that forward (kl then reports old vs new)
    max_grad_norm: float = 1.0
    advantage: str = "grpo"  # grpo (group-relative) | gae (PPO with the value head)
    gamma: float = 1.0
    gae_lambda: float = 0.95
    value_coef: float = 0.5
    temperature: float = 1.0  # of the training rollouts
    # the strategy: single or multi-turn (attempts with feedback between them)
    max_turns: int = 1  # mt4-grpo: 4, mt2-grpo: 2
    turn_discount: float = 0.9  # reward of a right answer at attempt t: turn_discount ** (t - 1)
    # model and task
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    warmstart_steps: int = 1200  # supervised steps before RL (cached on disk, about a minute of one core); 0: none
    max_response_len: int = 28  # tokens per attempt
    train_size: int = 4096  # problems in one epoch
    # evaluation
    eval_datasets: tuple[str, ...] = DATASETS
    eval_size: int = 128  # prompts per dataset
    eval_samples: int = 4  # samples per prompt (pass@k, maj@k); 128 x 4: a prompt-clustered SE of about 0.03
    eval_temperature: float = 1.0
    eval_redundancy: int | None = None  # ranks per sample of the full stage; None: 3 with 3+ ranks, else all
    eval_every_steps: int | None = 25
    eval_every_epochs: int | None = None
    eval_every_seconds: float | None = None
    eval_at_start: bool = True
    eval_at_end: bool = True  # a last round after the final step, unless that step was just evaluated
    eval_mode: str = "sync"  # sync (inline) | async (an evaluation process per rank, on a weight snapshot)
    eval_cpu_share: float = 1.0  # async: the share of a core the evaluation process may use
    eval_max_pending: int = 1  # async: rounds in the evaluation process at once; more are skipped
    eval_threads: int = 1
    two_stage: bool = True  # a quick subset first; the full set only when the quick stage calls for it
    quick_size: int = 16
    eval_turns: int | None = None  # attempts per evaluated sample (solved_within_<T>_turns); None: max_turns
    quick_alpha: float = 0.05  # the quick stage's gate: a sign test's false-positive rate (areal_train/gate.py)
    full_max_skipped: int = 3  # ... or after this many skipped full stages
    # checkpoints (every K steps and at the end) and the run's labels
    checkpoint_every_steps: int | None = 50
    checkpoint_every_seconds: float | None = None
    checkpoint_dir: str | None = None  # default: $AREAL_HOME/checkpoints
    group: str | None = None  # the run's group (compared runs share one); default: the strategy
    tags: tuple[str, ...] = ()
    # the stream worker's closed loop for this run (run.config.eval_loop, CONTRACT.md); None: the worker's settings
    eval_loop: dict[str, Any] | None = None
    # runtime
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 1  # torch threads per process
    publish: bool = True
    # fault injection, for demonstrations of degraded mode, dissent and a broken data copy
    fail_eval_at_steps: tuple[int, ...] = ()  # every rank's evaluation raises at these steps
    fail_eval_rounds: tuple[int, ...] = ()  # ... or in these rounds (1 = the first), whatever their step
    dissent_rank: int | None = None  # this rank publishes wrong verdicts (a faulty replica) ...
    dissent_kind: str = "flip"  # ... "flip": every fourth verdict flipped; "stuck": its grader returns 0 for all
    corrupt_eval_rank: int | None = None  # this rank's copy of the evaluation data differs (fingerprint check)

    def __post_init__(self) -> None:
        self._check()

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

    def _check(self) -> None:
        def need(ok: bool, key: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"{key}: {rule} (got {getattr(self, key)!r})")

        for key in ("batch_prompts", "ppo_epochs", "ppo_minibatches", "max_turns", "d_model", "layers", "heads",
                    "train_size", "eval_size", "eval_samples", "eval_max_pending", "eval_threads",
                    "quick_size", "threads"):
            need(getattr(self, key) >= 1, key, "must be >= 1")
        need(self.group_size >= 2, "group_size", "must be >= 2 (a group needs company)")
        need(self.warmstart_steps >= 0, "warmstart_steps", "must be >= 0")
        need(self.full_max_skipped >= 0, "full_max_skipped", "must be >= 0")
        need(self.eval_redundancy is None or self.eval_redundancy >= 1, "eval_redundancy", "must be >= 1")
        need(self.eval_turns is None or self.eval_turns >= 1, "eval_turns", "must be >= 1")
        need(0 < self.quick_alpha < 1, "quick_alpha", "must be in (0, 1)")
        need(self.d_model % self.heads == 0, "d_model", f"must be a multiple of heads ({self.heads})")
        need((self.batch_prompts * self.group_size) % self.ppo_minibatches == 0, "ppo_minibatches",
             "must divide batch_prompts * group_size")
        for key in ("lr", "clip_eps", "max_grad_norm", "temperature", "eval_temperature"):
            need(math.isfinite(getattr(self, key)) and getattr(self, key) > 0, key, "must be a finite number > 0")
        for key in ("entropy_coef", "kl_coef", "value_coef"):
            need(math.isfinite(getattr(self, key)) and getattr(self, key) >= 0, key, "must be a finite number >= 0")
        for key in ("gamma", "gae_lambda", "turn_discount"):
            need(0 <= getattr(self, key) <= 1, key, "must be in [0, 1]")
        need(0 < self.lr_min_scale <= 1, "lr_min_scale", "must be in (0, 1]")
        need(_compiles(self.rl_parameters), "rl_parameters", "must be a regular expression")
        need(0 < self.eval_cpu_share <= 1, "eval_cpu_share", "must be in (0, 1]")
        need(self.advantage in ("grpo", "gae"), "advantage", "must be grpo or gae")
        need(self.eval_mode in ("sync", "async"), "eval_mode", "must be sync or async")
        need(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
        need(len(self.eval_datasets) > 0 and all(d in DATASETS for d in self.eval_datasets)
             and len(set(self.eval_datasets)) == len(self.eval_datasets), "eval_datasets",
             f"must be a non-empty list of distinct names from {', '.join(DATASETS)}")
        need(self.eval_size <= EVAL_EXCLUDE_SIZE, "eval_size", f"must be <= {EVAL_EXCLUDE_SIZE}")
        need(self.quick_size <= self.eval_size, "quick_size", "must be <= eval_size")
        need(self.max_response_len >= 4, "max_response_len", "must be >= 4 (# , a digit and the end token)")
        for key in ("eval_every_steps", "eval_every_epochs", "checkpoint_every_steps"):
            need(getattr(self, key) is None or getattr(self, key) >= 1, key, "must be >= 1 or null")
        for key in ("eval_every_seconds", "checkpoint_every_seconds"):
            need(getattr(self, key) is None or getattr(self, key) > 0, key, "must be > 0 or null")
        need(all(s >= 0 for s in self.fail_eval_at_steps), "fail_eval_at_steps", "must be steps >= 0")
        need(all(r >= 1 for r in self.fail_eval_rounds), "fail_eval_rounds", "must be rounds >= 1")
        for key in ("dissent_rank", "corrupt_eval_rank"):
            need(getattr(self, key) is None or getattr(self, key) >= 0, key, "must be >= 0 or null")
        need(self.group is None or 0 < len(self.group) <= 256, "group", "must be 1..256 characters or null")
        need(self.dissent_kind in ("flip", "stuck"), "dissent_kind", "must be flip or stuck")

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values; `eval_loop` only when set (the run event's config: absent, not null)."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()
                if not (k == "eval_loop" and v is None)}

    def replace(self, **changes: Any) -> TrainConfig:
        return from_mapping({**self.to_dict(), **changes})


EVAL_LOOP_KEYS = ("enabled", "dataset", "stage", "threshold", "alpha", "patience_rounds", "factor", "min_factor",
                  "adaptive_interval", "rollback")


def _eval_loop(value: Any, where: str) -> dict[str, Any] | None:
    """The loop's settings pass through to the run event; the stream worker checks their values."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: eval_loop: must be an object of settings (got {type(value).__name__})")
    unknown = sorted(str(k) for k in value if k not in EVAL_LOOP_KEYS)
    if unknown:
        raise ConfigError(f"{where}: eval_loop: unknown key {', '.join(unknown)} (known: {', '.join(EVAL_LOOP_KEYS)})")
    bad = [k for k, v in value.items() if not isinstance(v, (bool, int, float, str))]
    if bad:
        raise ConfigError(f"{where}: eval_loop.{bad[0]}: must be a boolean, number or string")
    return dict(value)


def from_mapping(data: dict[str, Any], where: str = "config") -> TrainConfig:
    """Build a config from a mapping, checking every key's type (areal_metrics.producers.contract.config_fields)."""
    data = dict(data)
    loop = _eval_loop(data.pop("eval_loop", None), where)
    kwargs = typed_fields(TrainConfig, data, where)
    kwargs["eval_loop"] = loop
    try:
        return TrainConfig(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


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
