"""Trainer configuration: a dataclass of defaults that a JSON or TOML file overrides.

A bad value raises `ConfigError` naming the key and the file; the CLI turns it
into a one-line error with exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from areal_train.task import DATASETS


class ConfigError(ValueError):
    """A configuration value that breaks a rule; str says which key and why."""


@dataclass(frozen=True)
class TrainConfig:
    # optimisation
    seed: int = 0
    lr: float = 5e-3
    batch_prompts: int = 16  # prompts per rank and step
    group_size: int = 8  # responses per prompt (the GRPO group)
    ppo_epochs: int = 2  # passes over one rollout; >1 makes the clip matter
    clip_eps: float = 0.2
    entropy_coef: float = 0.01
    kl_coef: float = 0.02  # k3 estimator against the frozen initial policy
    max_grad_norm: float = 1.0
    advantage: str = "grpo"  # grpo (group-relative) | gae (PPO with a value head)
    gamma: float = 1.0
    gae_lambda: float = 0.95
    value_coef: float = 0.5
    # model and task
    hidden: int = 64
    max_response_len: int = 4
    train_dataset: str = "add_1digit"
    train_size: int = 100  # problems in one epoch
    # evaluation
    eval_datasets: tuple[str, ...] = ("add_1digit", "add_2digit")
    eval_size: int = 64
    eval_every_steps: int | None = 25
    eval_every_epochs: int | None = None
    eval_every_seconds: float | None = None
    eval_at_start: bool = True
    eval_at_end: bool = True  # a last round after the final step, unless that step was just evaluated
    eval_mode: str = "sync"  # sync | async (a snapshot of the weights, evaluated in a thread)
    two_stage: bool = True  # a quick subset first, then the full set
    quick_size: int = 16
    # runtime
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 1  # torch threads per process
    publish: bool = True
    # fault injection, for demonstrations of degraded mode and dissent
    fail_eval_at_steps: tuple[int, ...] = ()  # every rank's evaluation raises at these steps
    fail_eval_rounds: tuple[int, ...] = ()  # ... or in these rounds (1 = the first), whatever their step
    dissent_rank: int | None = None  # this rank flips some verdicts (a faulty replica)

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        def need(ok: bool, key: str, rule: str) -> None:
            if not ok:
                raise ConfigError(f"{key}: {rule} (got {getattr(self, key)!r})")

        for key in ("batch_prompts", "ppo_epochs", "hidden", "max_response_len", "train_size", "eval_size",
                    "quick_size", "threads"):
            need(getattr(self, key) >= 1, key, "must be >= 1")
        need(self.group_size >= 2, "group_size", "must be >= 2 (a group needs company)")
        for key in ("lr", "clip_eps", "max_grad_norm"):
            need(math.isfinite(getattr(self, key)) and getattr(self, key) > 0, key, "must be a finite number > 0")
        for key in ("entropy_coef", "kl_coef", "value_coef"):
            need(math.isfinite(getattr(self, key)) and getattr(self, key) >= 0, key, "must be a finite number >= 0")
        for key in ("gamma", "gae_lambda"):
            need(0 <= getattr(self, key) <= 1, key, "must be in [0, 1]")
        need(self.advantage in ("grpo", "gae"), "advantage", "must be grpo or gae")
        need(self.eval_mode in ("sync", "async"), "eval_mode", "must be sync or async")
        need(self.device in ("auto", "cpu", "cuda"), "device", "must be auto, cpu or cuda")
        need(self.train_dataset in DATASETS, "train_dataset", f"must be one of {', '.join(DATASETS)}")
        need(len(self.eval_datasets) > 0 and all(d in DATASETS for d in self.eval_datasets), "eval_datasets",
             f"must be a non-empty list of {', '.join(DATASETS)}")
        need(self.max_response_len >= 4, "max_response_len", "must be >= 4 (3 digits and the end token)")
        for key in ("eval_every_steps", "eval_every_epochs"):
            need(getattr(self, key) is None or getattr(self, key) >= 1, key, "must be >= 1 or null")
        need(self.eval_every_seconds is None or self.eval_every_seconds > 0, "eval_every_seconds",
             "must be > 0 or null")
        need(all(s >= 0 for s in self.fail_eval_at_steps), "fail_eval_at_steps", "must be steps >= 0")
        need(all(r >= 1 for r in self.fail_eval_rounds), "fail_eval_rounds", "must be rounds >= 1")
        need(self.dissent_rank is None or self.dissent_rank >= 0, "dissent_rank", "must be >= 0 or null")

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    def replace(self, **changes: Any) -> TrainConfig:
        return from_mapping({**self.to_dict(), **changes})


def from_mapping(data: dict[str, Any], where: str = "config") -> TrainConfig:
    """Build a config from a mapping, checking every key's type."""
    hints = get_type_hints(TrainConfig)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{where}: unknown key {_show(key)} (known: {', '.join(sorted(known))})")
        kwargs[key] = _coerce(key, value, hints[key], where)
    try:
        return TrainConfig(**kwargs)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _show(value: Any, limit: int = 60) -> str:
    """A value for an error message: repr, cut short (a config file may hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _coerce(key: str, value: Any, hint: Any, where: str) -> Any:
    text = str(hint)
    optional = "None" in text
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: {key}: must not be null")
    if "tuple" in text:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {key}: must be a list (got {_show(value)})")
        inner = int if "int" in text else str
        for item in value:
            if not isinstance(item, inner) or isinstance(item, bool):
                raise ConfigError(f"{where}: {key}: items must be {inner.__name__} (got {_show(item)})")
        return tuple(value)
    if hint is bool or text == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key}: must be true or false (got {_show(value)})")
        return value
    if "float" in text:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: {key}: must be a number (got {_show(value)})")
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{where}: {key}: number too large (got {_show(value)})") from None
    if "int" in text:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: {key}: must be an integer (got {_show(value)})")
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key}: must be a string (got {_show(value)})")
    return value


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


