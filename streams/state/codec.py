"""The one codec of the stream worker's state: frozen dataclasses <-> JSON bytes.

Every piece of state (areal_metrics.streams.core.processor.RunState and what it holds) is a frozen
dataclass with typed fields. `encode` and `decode` walk those types, so there is no
hand-written to_dict/from_dict per class and, above all, no key built by joining strings:
a structured key (a dataclass such as voting.RoundKey, a tuple) stays structured.

Encoding
- dataclass -> JSON object of its fields (a field missing on decode takes its default,
  so state written by an older worker still loads);
- tuple / list -> JSON array; a Mapping -> a JSON array of [key, value] pairs (keys may
  be dataclasses or tuples: nothing is ever parsed out of a string);
- str, int, float, bool, None -> themselves; `Any` -> the JSON value as is.

`decode` checks every value against its declared type and raises `StateDecodeError`
(naming the path of the bad field) for anything else, so a corrupt or foreign record is
refused as a whole instead of producing a half-valid state.

`dumps` and `loads` use orjson (compiled) when it is installed, else the standard
library; the bytes are the same. orjson writes a dataclass itself (7x faster than
walking it here), so `prepare` only rewrites the parts it would write otherwise: the
mappings (as [key, value] pairs) and whatever holds one. The state's dataclasses have
no `__slots__`: orjson writes a dataclass from its `__dict__` about 6x as fast as one
with slots (a smoothing window of 20 points: 26 against 9 us), and the worker writes a
run's head record once per batch. orjson writes a non-finite
float as null where `json` refuses it; `decode` then refuses the record (a number
expected), so such a state is never taken back silently.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from functools import cache
from typing import Any, Literal, TypeVar, Union
from areal_metrics.producers.contract.errors import ArealError

T = TypeVar("T")

try:
    import orjson
except ImportError:  # the standard library's codec: slower, same bytes
    orjson = None  # type: ignore[assignment]


class StateDecodeError(ArealError, ValueError):
    """A stored state record that does not decode to its type; the message names the field."""


def encode(obj: Any) -> Any:
    """A value built from dataclasses, tuples and mappings -> plain JSON data."""
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: encode(getattr(obj, f.name)) for f in _fields(type(obj))}
    if isinstance(obj, Mapping):
        return [[encode(k), encode(v)] for k, v in obj.items()]
    if isinstance(obj, (tuple, list)):
        return [encode(v) for v in obj]
    raise TypeError(f"stream state: cannot encode {type(obj).__name__}")


def prepare(obj: Any) -> Any:
    """`obj` with every part orjson would not write as `encode` does replaced by plain
    data: mappings become [key, value] pairs; dataclasses without a mapping inside stay."""
    if obj is None or isinstance(obj, (str, bool, int, float)):
        return obj
    cls = type(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if _plain(cls):
            return obj
        return {name: prepare_as(hint, getattr(obj, name)) for name, hint in _field_hints(cls)}
    if isinstance(obj, Mapping):
        return [[prepare(k), prepare(v)] for k, v in obj.items()]
    if isinstance(obj, (tuple, list)):
        return [prepare(v) for v in obj]
    raise TypeError(f"stream state: cannot encode {cls.__name__}")


def prepare_as(tp: Any, obj: Any) -> Any:
    """`prepare(obj)` for a value of the declared type `tp`: the value as it is when orjson
    writes every value of that type as `encode` would (no mapping inside), without walking it
    (a run's list of waiting steps can hold hundreds of (attempt, step) keys)."""
    return obj if _plain_hint(tp) else prepare(obj)


def dumps(obj: Any) -> bytes:
    return dump_prepared(prepare(obj))


def dump_prepared(data: Any) -> bytes:
    """JSON bytes of what `prepare` returned (or of plain JSON data)."""
    if orjson is not None:
        return orjson.dumps(data)
    # what prepare left as it is: plain dataclasses (no mapping inside)
    return json.dumps(data, default=encode, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def parse(raw: bytes | str) -> Any:
    """JSON bytes -> plain data; StateDecodeError when they are not JSON."""
    try:
        return orjson.loads(raw) if orjson is not None else json.loads(raw)
    except (ValueError, UnicodeDecodeError, TypeError) as exc:
        raise StateDecodeError(f"stream state: not JSON ({exc})") from None


def loads(cls: type[T], raw: bytes | str) -> T:
    """JSON bytes -> an instance of `cls`; StateDecodeError for anything that does not fit."""
    return decode(cls, parse(raw))


def decode(tp: Any, data: Any, path: str = "$") -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (Union, types.UnionType):
        return _decode_union(tp, data, path)
    if origin is Literal:
        if data not in typing.get_args(tp):
            raise StateDecodeError(f"stream state {path}: {data!r} is not one of {typing.get_args(tp)}")
        return data
    if origin is tuple:
        return _decode_tuple(tp, data, path)
    if origin in (Mapping, dict) or tp in (Mapping, dict):
        return _decode_mapping(tp, data, path)
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, data, path)
    if tp is type(None):
        if data is not None:
            raise StateDecodeError(f"stream state {path}: expected null, got {type(data).__name__}")
        return None
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise StateDecodeError(f"stream state {path}: expected a number, got {type(data).__name__}")
        return float(data)
    if tp in (int, str, bool):
        if not isinstance(data, tp) or (tp is int and isinstance(data, bool)):
            raise StateDecodeError(f"stream state {path}: expected {tp.__name__}, got {type(data).__name__}")
        return data
    raise StateDecodeError(f"stream state {path}: no decoder for {tp!r}")


def _decode_union(tp: Any, data: Any, path: str) -> Any:
    args = typing.get_args(tp)
    if data is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return decode(arg, data, path)
        except StateDecodeError as exc:
            errors.append(str(exc))
    raise StateDecodeError(errors[0] if len(errors) == 1 else f"stream state {path}: fits none of {tp!r}")


def _decode_tuple(tp: Any, data: Any, path: str) -> tuple[Any, ...]:
    if not isinstance(data, list):
        raise StateDecodeError(f"stream state {path}: expected an array, got {type(data).__name__}")
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
    if len(args) != len(data):
        raise StateDecodeError(f"stream state {path}: expected {len(args)} items, got {len(data)}")
    return tuple(decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))


def _decode_mapping(tp: Any, data: Any, path: str) -> dict[Any, Any]:
    args = typing.get_args(tp) or (Any, Any)
    if not isinstance(data, list):
        raise StateDecodeError(f"stream state {path}: expected an array of [key, value] pairs")
    out: dict[Any, Any] = {}
    for i, pair in enumerate(data):
        if not isinstance(pair, list) or len(pair) != 2:
            raise StateDecodeError(f"stream state {path}[{i}]: expected a [key, value] pair")
        key = decode(args[0], pair[0], f"{path}[{i}].key")
        out[key] = decode(args[1], pair[1], f"{path}[{i}].value")
    return out


def _decode_dataclass(cls: type[T], data: Any, path: str) -> T:
    if not isinstance(data, dict):
        raise StateDecodeError(f"stream state {path}: expected an object for {cls.__name__}")
    hints = _hints(cls)
    values = {}
    for f in _fields(cls):
        if f.name in data:
            values[f.name] = decode(hints[f.name], data[f.name], f"{path}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise StateDecodeError(f"stream state {path}.{f.name}: missing")
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise StateDecodeError(f"stream state {path}: {exc}") from None


@cache
def _plain(cls: type) -> bool:
    """True when orjson's own encoding of dataclass `cls` is `encode`'s (no mapping inside)."""
    return all(_plain_type(hint) for hint in _hints(cls).values())


@cache
def _plain_hint(tp: Any) -> bool:
    return _plain_type(tp)


@cache
def _field_hints(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, declared type) of each field of dataclass `cls`, in order."""
    hints = _hints(cls)
    return tuple((f.name, hints[f.name]) for f in _fields(cls))


def _plain_type(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp in (str, int, float, bool, type(None)) or origin is Literal:
        return True
    if origin in (Union, types.UnionType, tuple):
        return all(a is Ellipsis or _plain_type(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return _plain(tp)
    return False  # Any, mappings, anything else: walked by `prepare`


@cache
def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(f for f in dataclasses.fields(cls) if f.init)


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)
