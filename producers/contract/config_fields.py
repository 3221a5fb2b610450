"""One loader for the project's configuration Structs, read from JSON or TOML (pure).

A config is a frozen `msgspec.Struct` subclassing `Config`: each field's annotation is its type,
its `Meta` its range (`ge`, `gt`, `le`, `lt`, lengths; a `Literal` its choices) and its
`description` the knob's text, beside it. msgspec converts each value to its type (strict: no
string is read as a number or a flag); on top comes what JSON and hand-written TOML need: `30.0`
is accepted where an integer is meant (an integer where a float is, and a list where a tuple is,
msgspec accepts itself), and a float must be finite. Unknown keys are refused
(`forbid_unknown_fields`). The same checks run when a config is built in code (`Config.__post_init__`),
loaded (`load`) or changed (`replaced`); rules between fields are each class's `cross_check`.

Every error is a `ConfigError` naming the field: `<where>: <field>: must be in (0, 1] (got 2)`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Mapping
from functools import cache
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import msgspec

from areal_metrics.producers.contract.errors import ConfigError

C = TypeVar("C", bound="Config")
_INT64 = 2**63  # msgspec takes any Python int; a knob beyond 64 bits is a typo or an attack


def show(value: Any, limit: int = 60) -> str:
    """A value for an error message: repr, cut short (a config file may hold anything)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of the configuration Structs: every path that makes one checks every field."""

    def __post_init__(self) -> None:
        check_fields(self)
        self.cross_check()

    def cross_check(self) -> None:
        """Rules between fields (raise ConfigError naming the field); none by default."""


def load(cls: type[C], data: Any, where: str) -> C:
    """`data` (a mapping read from JSON or TOML) as a `cls`; ConfigError names `where` and the field."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: not an object")
    try:
        return msgspec.convert({k: _whole_floats_as_ints(v) for k, v in data.items()}, cls)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {_explain(cls, str(exc), data)}") from None
    except ConfigError as exc:  # a field or a cross-field rule, from __post_init__
        raise ConfigError(f"{where}: {exc}") from None


def replaced(config: C, changes: Mapping[str, Any], where: str) -> C:
    """`config` with `changes` (untrusted values), converted and checked as `load` does."""
    return load(type(config), {**msgspec.structs.asdict(config), **changes}, where)


def check_fields(config: Config) -> None:
    """Each field of `config` against its annotation and Meta, and finite: for a config built in code."""
    cls = type(config)
    values = msgspec.structs.asdict(config)
    try:
        msgspec.convert(values, _fields_struct(cls))
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(cls, str(exc), values)) from None
    isfinite = math.isfinite
    for name, value in values.items():
        if (type(value) is float and not isfinite(value)) or (type(value) is tuple and not _finite(value)):
            raise ConfigError(f"{name}: not finite (got {show(value)})")
        if type(value) is int and not -_INT64 <= value < _INT64:
            raise ConfigError(f"{name}: too large (got {show(value)})")


@dataclasses.dataclass(frozen=True)
class Knob:
    """One field of a config, as docs and error messages show it."""

    name: str
    default: Any
    rule: str  # what values it takes ("in (0, 1]", "quick or full"); "" when any of its type
    description: str
    extra: Mapping[str, Any]  # Meta(extra=...): e.g. the section it opens


def knobs(cls: type[Config]) -> Iterator[Knob]:
    """`cls`'s fields in order, with their defaults, rules and descriptions."""
    hints = _hints(cls)
    for f in msgspec.structs.fields(cls):
        metas = _metas(hints[f.name])
        description = " ".join(m.description for m in metas if m.description)
        extra: dict[str, Any] = {}
        for m in metas:
            extra.update(m.extra or {})
        default = f.default if f.default is not msgspec.NODEFAULT else None
        yield Knob(f.name, default, rule(hints[f.name]), description, extra)


def rule(hint: Any) -> str:
    """The values a field's annotation allows, in words: `in (0, 1]`, `>= 1`, `quick or full`."""
    base, metas = _unwrap(hint)
    if base is bool:
        return "true or false"
    if get_origin(base) is Literal:
        choices = [str(c) for c in get_args(base)]
        return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]
    parts = []
    for m in metas:
        lo = (f"[{_num(m.ge)}", m.ge) if m.ge is not None else (f"({_num(m.gt)}", m.gt) if m.gt is not None else None
        hi = (f"{_num(m.le)}]", m.le) if m.le is not None else (f"{_num(m.lt)})", m.lt) if m.lt is not None else None
        if lo and hi:
            parts.append(f"in {lo[0]}, {hi[0]}")
        elif lo:
            parts.append(f"{'>=' if m.ge is not None else '>'} {_num(lo[1])}")
        elif hi:
            parts.append(f"{'<=' if m.le is not None else '<'} {_num(hi[1])}")
        if m.min_length is not None or m.max_length is not None:
            unit = "characters" if base is str else "items"
            if m.max_length is None:
                parts.append("non-empty" if m.min_length == 1 else f"at least {m.min_length} {unit}")
            else:
                parts.append(f"{m.min_length or 0}..{m.max_length} {unit}")
    return ", ".join(parts)


# -- inside


@cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls, include_extras=True)


@cache
def _fields_struct(cls: type[Config]) -> type[msgspec.Struct]:
    """A plain Struct of `cls`'s fields (no __post_init__), to check a built config's values."""
    hints = _hints(cls)
    return msgspec.defstruct(f"{cls.__name__}Fields", [(name, hints[name]) for name in cls.__struct_fields__])


def _unwrap(hint: Any) -> tuple[Any, list[msgspec.Meta]]:
    """(the type without Optional and Annotated, the Meta annotations found on the way)."""
    metas: list[msgspec.Meta] = []
    while True:
        if get_origin(hint) is Annotated:
            hint, *extras = get_args(hint)
            metas += [m for m in extras if isinstance(m, msgspec.Meta)]
        elif get_origin(hint) in (Union, UnionType) and NoneType in get_args(hint):
            rest = [a for a in get_args(hint) if a is not NoneType]
            if len(rest) != 1:
                return hint, metas
            hint = rest[0]
        else:
            return hint, metas


def _metas(hint: Any) -> list[msgspec.Meta]:
    return _unwrap(hint)[1]


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.S)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>.*)`$", re.S)
_OUT_OF_RANGE = re.compile(r"^(Expected `[^`]*` (?!,)|Invalid enum value)")  # the type was right, the value not


def _explain(cls: type, message: str, data: Mapping[str, Any]) -> str:
    """msgspec's ValidationError in this project's words: the field, the rule, the value."""
    m = _AT.match(message)
    msg, path = (m["msg"], m["path"] or "") if m else (message, "")
    unknown = _UNKNOWN.match(msg)
    if unknown:
        where = f"{path.lstrip('.')}: " if path else ""
        known = f" (known: {', '.join(sorted(getattr(cls, '__struct_fields__', ())))})" if not path else ""
        return f"{where}unknown key {show(unknown['key'])}{known}"
    name = path.lstrip(".")
    top = re.match(r"[^.\[]*", name)
    field = top[0] if top else name
    if not field:
        return msg
    value = data.get(field)
    if field != name:  # inside the field's value: msgspec's path within it, as converting the value alone says
        return f"{field}: {msg} - at `${name[len(field):]}` ({show(value)})"
    allowed = rule(_hints(cls).get(field)) if _OUT_OF_RANGE.match(msg) else ""
    if allowed:
        return f"{name}: must be {allowed} (got {show(value)})"
    return f"{name}: {msg} ({show(value)})"


def _whole_floats_as_ints(value: Any) -> Any:
    """`30.0` -> `30` (in lists too): msgspec refuses a float for an int, and converts an int
    back to a float where a float is meant. Objects (a field of free-form settings) pass as they are."""
    if type(value) is float and value.is_integer():
        return int(value)
    if isinstance(value, (list, tuple)):
        return [_whole_floats_as_ints(v) for v in value]
    return value


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    return all(map(_finite, value)) if isinstance(value, tuple) else True

