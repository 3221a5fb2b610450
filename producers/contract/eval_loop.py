"""`run.config.eval_loop`: the keys a run sets for the stream worker's closed loop, declared once (pure).

CONTRACT.md, "Evaluation you can trust" and "Decisions under real conditions", names the keys;
`EVAL_LOOP` holds each key's type, its range in the type's `Meta` (the aliases below). The stream
worker's knobs take their types from these aliases (`streams/core/config.py`:
`lr_alpha: Annotated[Alpha, ...]`), and both the worker (a run event's `eval_loop`) and the
reference trainer (its `eval_loop` setting, `areal_train/config.py`) check a mapping with
`check`, so both accept and refuse the same mappings in the same words. A missing key takes
the worker's setting; null is a value only where the worker's knob has one (`dataset`,
`threshold`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from areal_metrics.producers.contract.config_fields import Config, load
from areal_metrics.producers.contract.errors import ConfigError

# The values each key takes (the worker's knob of that key has the same type).
Dataset = Annotated[str, Meta(min_length=1, max_length=128)]
Stage = Literal["quick", "full"]
Threshold = Annotated[float, Meta(ge=0, le=1)]
Alpha = Annotated[float, Meta(gt=0, le=0.5)]
PatienceRounds = Annotated[int, Meta(ge=0)]
Factor = Annotated[float, Meta(gt=0, lt=1)]
# 0.01: a restore of the whole way back (1 / floor) must stay a valid factor (<= 100).
MinFactor = Annotated[float, Meta(ge=0.01, le=1)]
HorizonRounds = Annotated[int, Meta(ge=1, le=1_000_000)]
RaiseAfterRounds = Annotated[int, Meta(ge=0)]

# key -> the type of its value, in CONTRACT.md's order.
EVAL_LOOP: dict[str, Any] = {
    "enabled": bool,
    "dataset": Dataset | None,  # null: the run's first dataset of the stage
    "stage": Stage,
    "threshold": Threshold | None,  # null: no threshold
    "alpha": Alpha,
    "patience_rounds": PatienceRounds,
    "factor": Factor,
    "min_factor": MinFactor,
    "adaptive_interval": bool,
    "rollback": bool,
    "horizon_rounds": HorizonRounds,
    "raise_after_rounds": RaiseAfterRounds,
}
KEY_SHOWN = 64  # characters of an unknown key an error repeats


def refusal(key: str, value: Any) -> str | None:
    """Why `value` is no value of `key` (None: it is), in the config loader's words:
    `must be in (0, 0.5] (got 0.9)`, `Expected `bool`, got `str` ('yes')`, `unknown (known: ...)`."""
    if key not in EVAL_LOOP:
        return f"unknown (known: {', '.join(EVAL_LOOP)})"
    try:
        load(_one(key), {key: value}, "eval_loop")
    except ConfigError as exc:
        return str(exc).removeprefix(f"eval_loop: {key}: ")
    return None


def check(raw: Mapping[Any, Any]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """A `run.config.eval_loop` mapping (untrusted) -> (the keys it sets validly, with their values
    as given; (key, why) for each refused key, the key cut to KEY_SHOWN characters)."""
    good: dict[str, Any] = {}
    refused: list[tuple[str, str]] = []
    for key, value in raw.items():
        why = refusal(key, value) if isinstance(key, str) else f"unknown (known: {', '.join(EVAL_LOOP)})"
        if why is None:
            good[key] = value
        else:
            refused.append((str(key)[:KEY_SHOWN], why))
    return good, refused


@cache
def _one(key: str) -> type[Config]:
    """A config of the one field `key`: its value converted and checked as every config's are."""
    return msgspec.defstruct(f"eval_loop_{key}", [(key, EVAL_LOOP[key])], bases=(Config,), frozen=True,
                             forbid_unknown_fields=True)
