"""One loader for configuration dataclasses read from JSON or TOML (pure).

The trainer's config and the stream worker's per-run config are frozen dataclasses filled
from files and from run events. Each value is converted to its field's annotated type by
msgspec (strict: no string is read as a number or a flag), with what JSON and hand-written
TOML need on top: unknown keys are refused by name, `30.0` is accepted where an integer is
meant (an integer where a float is, and a list where a tuple is, msgspec accepts itself), and a
float must be finite. Range rules stay in each dataclass's `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from functools import cache
from typing import Any, get_type_hints

import msgspec

from areal_metrics.producers.contract.errors import ConfigError


def show(value: Any, limit: int = 60) -> str:
    """A value for an error message: repr, cut short (a config file may hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@cache
def _hints(cls: type) -> dict[str, Any]:
    """The annotated type of each field of dataclass `cls` that __init__ takes."""
    hints = get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def typed_fields(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`data` checked against `cls`'s fields and converted to their annotated types.

    Raises ConfigError naming `where` and the key; the result can be passed to
    `cls(**result)` or `dataclasses.replace(instance, **result)`.
    """
    hints = _hints(cls)
    unknown = sorted((k for k in data if k not in hints), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key {', '.join(show(k) for k in unknown)} "
                          f"(known: {', '.join(sorted(hints))})")
    return {key: _convert(key, value, hints[key], where) for key, value in data.items()}


def _convert(key: str, value: Any, hint: Any, where: str) -> Any:
    try:
        converted = msgspec.convert(_whole_floats_as_ints(value), hint)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {key}: {exc} ({show(value)})") from None
    if not _finite(converted):
        raise ConfigError(f"{where}: {key}: not finite (got {show(value)})")
    return converted


def _whole_floats_as_ints(value: Any) -> Any:
    """`30.0` -> `30` (in lists too): msgspec refuses a float for an int, and converts an int
    back to a float where a float is meant."""
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, (list, tuple)):
        return [_whole_floats_as_ints(v) for v in value]
    return value


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return all(map(_finite, value)) if isinstance(value, tuple) else True
