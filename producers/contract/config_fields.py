"""One loader for configuration dataclasses read from JSON or TOML (pure).

The trainer's config and the stream worker's per-run config are frozen
dataclasses filled from files and from run events. JSON has one number type
and TOML files are written by hand, so values are checked and converted by the
field's annotation here, once: unknown keys are refused by name, `30.0` is
accepted where an integer is meant, an integer where a float is, a list where
a tuple is. Range rules stay in each dataclass's `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin, get_type_hints

from areal_metrics.producers.contract.errors import ConfigError


def show(value: Any, limit: int = 60) -> str:
    """A value for an error message: repr, cut short (a config file may hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def typed_fields(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`data` checked against `cls`'s fields and converted to their annotated types.

    Raises ConfigError naming `where` and the key; the result can be passed to
    `cls(**result)` or `dataclasses.replace(instance, **result)`.
    """
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted((k for k in data if k not in known), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key {', '.join(show(k) for k in unknown)} "
                          f"(known: {', '.join(sorted(known))})")
    return {key: _convert(key, value, hints[key], where) for key, value in data.items()}


def _convert(key: str, value: Any, hint: Any, where: str) -> Any:
    args = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) in (Union, types.UnionType):  # `X | None`: the only unions in our configs
        if value is None:
            return None
        return _convert(key, value, args[0], where)
    if value is None:
        raise ConfigError(f"{where}: {key}: must not be null")
    if get_origin(hint) is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: {key}: must be a list (got {show(value)})")
        return tuple(_convert(key, item, args[0], where) for item in value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: {key}: must be true or false (got {show(value)})")
        return value
    if hint in (int, float):
        return _number(key, value, hint is int, where)
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {key}: must be a string (got {show(value)})")
    return value


def _number(key: str, value: Any, integer: bool, where: str) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: {key}: must be {'an integer' if integer else 'a number'} (got {show(value)})")
    if integer:
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{where}: {key}: must be an integer (got {show(value)})")
            return int(value)
        return value
    try:
        converted = float(value)
    except OverflowError:
        raise ConfigError(f"{where}: {key}: number too large (got {show(value)[:40]})") from None
    if not math.isfinite(converted):
        raise ConfigError(f"{where}: {key}: not finite (got {show(value)})")
    return converted
