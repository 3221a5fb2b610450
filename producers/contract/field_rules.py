"""The rules of the event fields: types read off the annotations, ranges from `rule(...)`.

`areal_metrics.producers.contract.events` declares the records; this module checks a value against
its field (`check_value`), so that every reader refuses bad input with an
error naming the field (`ValidationError`: ``<table>.<field>: <rule>``).
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Union, get_args, get_origin, get_type_hints

from areal_metrics.producers.contract.errors import UserError

METRIC_NAME_MAX = 256  # a `metrics` name: 1..256 chars
SAMPLE_TEXT_MAX = 4096  # an eval sample's prompt or response: chars kept (the client truncates)
SAMPLES_MAX = 64  # eval samples per event (the client keeps the first ones)
METRICS_MAX = 1024  # `metrics` names per event (the client keeps the first ones)
JSON_KEY_MAX = 256  # a key of a free-form object (config, args): chars


class ValidationError(UserError, ValueError):
    """Input that breaks the contract. `str(err)` is ``<table>.<field>: <rule>``."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


@dataclass(frozen=True, slots=True)
class Rule:
    """Constraints of one field beyond its type."""

    ge: float | None = None
    le: float | None = None
    choices: tuple[str, ...] | None = None
    pattern: re.Pattern[str] | None = None
    max_len: int | None = None
    nonempty: bool = False


def rule(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, **kw: Any) -> Any:
    return field(default=default, default_factory=factory, metadata={"rule": Rule(**kw)})


# ---------------------------------------------------------------- field checks


@dataclass(frozen=True, slots=True)
class _Check:
    name: str
    kind: str  # int | float | str | bool | int_list | str_list | float_map | json_map | sample_list
    optional: bool
    rule: Rule
    # True only for a value that `check_value` accepts as it is (no conversion either): the
    # common shapes, tested in one comparison chain. Anything else takes the full check,
    # which alone words the errors (tests/test_field_rules_fast.py holds the two together).
    passes: Callable[[Any], bool] = field(default=lambda v: False, compare=False)


_KINDS: dict[Any, str] = {int: "int", float: "float", str: "str", bool: "bool"}


def _kind_of(hint: Any) -> tuple[str, bool]:
    optional = False
    if get_origin(hint) in (Union, types.UnionType):
        args = [a for a in get_args(hint) if a is not type(None)]
        optional = len(args) < len(get_args(hint))
        hint = args[0]
    if hint in _KINDS:
        return _KINDS[hint], optional
    origin, args = get_origin(hint), get_args(hint)
    if origin is tuple and args[0] is int:
        return "int_list", optional
    if origin is tuple and args[0] is str:
        return "str_list", optional
    if origin is tuple and get_origin(args[0]) is Mapping:
        return "sample_list", optional
    if origin is Mapping and args[1] is float:
        return "float_map", optional
    if origin is Mapping:
        return "json_map", optional
    raise TypeError(f"unsupported field type {hint!r}")


_CHECKS: dict[type, tuple[_Check, ...]] = {}


def field_checks(cls: type) -> tuple[_Check, ...]:
    found = _CHECKS.get(cls)
    if found is None:
        hints = get_type_hints(cls)
        found = []
        for f in dataclasses.fields(cls):
            kind, optional = _kind_of(hints[f.name])
            r = f.metadata.get("rule", Rule())
            found.append(_Check(f.name, kind, optional, r, _passes(kind, optional, r)))
        _CHECKS[cls] = tuple(found)
    return _CHECKS[cls]


_GETTERS: dict[type, Callable[[Any], tuple[Any, ...]]] = {}


def field_values(obj: Any) -> tuple[Any, ...]:
    """The values of `obj`'s fields, in `field_checks` order (one C call, not one per field)."""
    getter = _GETTERS.get(type(obj))
    if getter is None:
        names = [c.name for c in field_checks(type(obj))]
        getter = _GETTERS[type(obj)] = operator.attrgetter(*names) if len(names) > 1 else (
            lambda o: (getattr(o, names[0]),))
    return getter(obj)


# ---------------------------------------------------------------- storage-safe text
#
# One rule for every string a reader takes (fields, list entries, `metrics` names, the keys
# and strings of config/args, sample text): what ClickHouse's String columns and Kafka keys
# hold as UTF-8. A lone surrogate (the JSON escape "\ud800" decodes to one) cannot be
# encoded as UTF-8, so no insert could ever store it; NUL ends a string for C clients and
# tools reading the tables. Invalid UTF-8 bytes never reach here: the JSON decoder refuses
# them. Bidi controls and 4-byte characters are valid text and are stored as they are.


def _utf8_ok(v: str) -> bool:
    """Can `v` be encoded as UTF-8 (no lone surrogate)?"""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def text_problem(v: str) -> str | None:
    """Why `v` cannot be stored as it is (a NUL, a lone surrogate), or None."""
    i = v.find("\x00")
    if i >= 0:
        return f"holds a NUL character (at index {i})"
    if not v.isascii():
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as exc:
            return (f"holds a lone surrogate U+{ord(v[exc.start]):04X} (at index {exc.start}), "
                    "which UTF-8 cannot encode")
    return None


def check_text(where: str, v: str) -> None:
    """Raise ValidationError naming `where` when `v` is not storage-safe text."""
    problem = text_problem(v)
    if problem is not None:
        raise ValidationError(where, problem)


def storage_safe(v: str) -> str:
    """`v` with each NUL and lone surrogate replaced by U+FFFD: the client's normalisation of a
    name or text it was given (readers refuse such text instead, to the dead-letter topic)."""
    if text_problem(v) is None:
        return v
    return "".join("\ufffd" if c == "\x00" or "\ud800" <= c <= "\udfff" else c for c in v)


def _accept_source(kind: str, optional: bool, r: Rule, v: str, consts: dict[str, Any]) -> str:
    """The fast accept of one field as a Python expression over the variable `v`: exact
    types, bounds folded into one range. Its constants go into `consts` (named after `v`).
    One source for both uses: a field's own `_Check.passes` and a record's `record_accept`."""
    lo = -math.inf if r.ge is None else r.ge
    hi = math.inf if r.le is None else r.le
    consts.update({f"{v}_lo": lo, f"{v}_hi": hi, f"{v}_ilo": max(lo, _INT64[0]), f"{v}_ihi": min(hi, _INT64[1])})
    none = f"({v} is None and {optional})"
    if kind == "int":
        return f"{none} or (type({v}) is int and {v}_ilo <= {v} <= {v}_ihi)"
    if kind == "float":  # NaN fails every comparison; +-inf fail the strict ones
        return (f"{none} or (type({v}) is float and {v}_lo <= {v} <= {v}_hi and -_inf < {v} < _inf)"
                f" or (type({v}) is int and {v}_ilo <= {v} <= {v}_ihi)")
    if kind == "str":
        longest = math.inf if r.max_len is None else r.max_len
        consts.update({f"{v}_short": 1 if r.nonempty else 0, f"{v}_long": longest,
                       f"{v}_choices": r.choices, f"{v}_pattern": r.pattern})
        text = (f"type({v}) is str and {v}_short <= len({v}) <= {v}_long"
                f" and '\\x00' not in {v} and ({v}.isascii() or _utf8_ok({v}))")
        if r.choices is not None:
            text += f" and {v} in {v}_choices"
        if r.pattern is not None:
            text += f" and {v}_pattern.fullmatch({v}) is not None"
        return f"{optional} if {v} is None else ({text})"
    if kind == "bool":
        return f"{none} or type({v}) is bool"
    if kind == "float_map":  # a frozen map of named finite numbers
        return f"{optional} if {v} is None else _float_map_ok({v})"
    if kind == "json_map":  # an empty, already frozen map; a filled one is checked in full
        return f"{none} or (type({v}) is _proxy and not {v})"
    return f"{none} or (type({v}) is tuple and not {v})"  # lists: an empty tuple; anything else in full


def _float_map_ok(v: Any) -> bool:
    if type(v) is not types.MappingProxyType or len(v) > METRICS_MAX:
        return False
    for k, x in v.items():
        t = type(x)
        if not (type(k) is str and 0 < len(k) <= METRIC_NAME_MAX and "\x00" not in k
                and (k.isascii() or _utf8_ok(k)) and (
                (t is float and -math.inf < x < math.inf) or (t is int and _INT64[0] <= x <= _INT64[1]))):
            return False
    return True


_ACCEPT_GLOBALS = {"_inf": math.inf, "_proxy": types.MappingProxyType, "_float_map_ok": _float_map_ok,
                   "_utf8_ok": _utf8_ok}


def _accept_body(terms: list[str]) -> str:
    return " and ".join(f"({t})" for t in terms) or "True"


def _compile_accept(params: list[str], body: str, namespace: dict[str, Any], name: str) -> Callable[..., bool]:
    exec(f"def {name}({', '.join(params)}):\n    return {body}\n", namespace)  # noqa: S102 - our own text
    return namespace[name]  # type: ignore[no-any-return]


def _passes(kind: str, optional: bool, r: Rule) -> Callable[[Any], bool]:
    namespace: dict[str, Any] = dict(_ACCEPT_GLOBALS)
    return _compile_accept(["v"], _accept_body([_accept_source(kind, optional, r, "v", namespace)]), namespace,
                           "accept")


_RECORD_ACCEPT: dict[type, Callable[..., bool]] = {}


def record_accept_source(cls: type, names: list[str]) -> tuple[str, dict[str, Any]]:
    """(a Python expression over the variables `names`, one per field in `field_checks`
    order, that is True when every field's fast accept is; the constants and helpers it
    needs). The same expressions as the fields' `passes`, for code that checks a whole record
    in one expression (`record_accept`, the records' generated __init__ and reader)."""
    consts: dict[str, Any] = dict(_ACCEPT_GLOBALS)
    terms = [_accept_source(c.kind, c.optional, c.rule, v, consts) for c, v in zip(field_checks(cls), names)]
    return _accept_body(terms), consts


def record_accept(cls: type) -> Callable[..., bool]:
    """One function that takes a record's values (in `field_checks` order) and is True when
    every field's fast accept is, in one call rather than one per field."""
    found = _RECORD_ACCEPT.get(cls)
    if found is None:
        params = [f"v{i}" for i in range(len(field_checks(cls)))]
        found = _RECORD_ACCEPT[cls] = _compile_accept(params, *record_accept_source(cls, params),
                                                      f"accept_{cls.__name__}")
    return found


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_INT64 = (-(2**63), 2**64 - 1)  # what Int64 and UInt64 columns hold between them


def check_number(where: str, v: Any, r: Rule) -> None:
    if isinstance(v, int):
        if not _INT64[0] <= v <= _INT64[1]:  # math on such ints overflows floats; no column holds them
            raise ValidationError(where, f"integer out of the 64-bit range ({len(str(abs(v)))} digits)")
    elif not math.isfinite(v):
        raise ValidationError(where, f"not finite ({v})")
    if r.ge is not None and v < r.ge:
        raise ValidationError(where, f"must be >= {r.ge:g} (got {v!r})")
    if r.le is not None and v > r.le:
        raise ValidationError(where, f"must be <= {r.le:g} (got {v!r})")


def _check_str(where: str, v: Any, r: Rule) -> None:
    if not isinstance(v, str):
        raise ValidationError(where, f"not a string ({type(v).__name__})")
    if r.nonempty and not v:
        raise ValidationError(where, "must not be empty")
    if r.max_len is not None and len(v) > r.max_len:
        raise ValidationError(where, f"longer than {r.max_len} chars ({len(v)})")
    check_text(where, v)
    if r.choices is not None and v not in r.choices:
        raise ValidationError(where, f"{_short(v)!r} is not one of {', '.join(r.choices)}")
    if r.pattern is not None and not r.pattern.fullmatch(v):
        raise ValidationError(where, f"{_short(v)!r} does not match {r.pattern.pattern}")


def _short(v: str, n: int = 40) -> str:
    return v if len(v) <= n else v[:n] + "..."


def check_value(where: str, c: _Check, v: Any) -> None:
    kind, r = c.kind, c.rule
    if kind == "int":
        if not is_int(v):
            raise ValidationError(where, f"not an integer ({type(v).__name__})")
        check_number(where, v, r)
    elif kind == "float":
        if not is_number(v):
            raise ValidationError(where, f"not a number ({type(v).__name__})")
        check_number(where, v, r)
    elif kind == "str":
        _check_str(where, v, r)
    elif kind == "bool":
        if not isinstance(v, bool):
            raise ValidationError(where, f"not a boolean ({type(v).__name__})")
    elif kind == "int_list":
        if not isinstance(v, tuple):
            raise ValidationError(where, f"not a list ({type(v).__name__})")
        if r.max_len is not None and len(v) > r.max_len:
            raise ValidationError(where, f"more than {r.max_len} entries ({len(v)})")
        lo, hi = (0, 1) if r.ge is None else (r.ge, r.le if r.le is not None else _INT64[1])  # verdicts: 0/1
        for i, x in enumerate(v):
            if not is_int(x) or not lo <= x <= hi:
                raise ValidationError(f"{where}[{i}]", f"must be 0 or 1 (got {x!r})" if r.ge is None
                                      else f"must be an integer in [{lo}, {hi}] (got {x!r})")
    elif kind == "str_list":
        if not isinstance(v, tuple):
            raise ValidationError(where, f"not a list ({type(v).__name__})")
        if r.max_len is not None and len(v) > r.max_len:
            raise ValidationError(where, f"more than {r.max_len} entries ({len(v)})")
        for i, x in enumerate(v):
            _check_str(f"{where}[{i}]", x, Rule(max_len=256))
    elif kind == "float_map":
        if not isinstance(v, Mapping):
            raise ValidationError(where, f"not an object ({type(v).__name__})")
        if len(v) > METRICS_MAX:
            raise ValidationError(where, f"more than {METRICS_MAX} names ({len(v)})")
        for k, x in v.items():
            _check_str(f"{where} key", k, Rule(max_len=METRIC_NAME_MAX, nonempty=True))
            if not is_number(x):
                raise ValidationError(f"{where}.{k}", f"not a number ({type(x).__name__})")
            check_number(f"{where}.{k}", x, Rule())
    elif kind == "json_map":
        if not isinstance(v, Mapping):
            raise ValidationError(where, f"not an object ({type(v).__name__})")
        _check_json(where, v, 0)
    elif kind == "sample_list":
        _check_samples(where, v)


def _check_json(where: str, v: Any, depth: int) -> None:
    """Nested JSON (a config): string keys, finite numbers, bounded depth."""
    if depth > 32:
        raise ValidationError(where, "nested too deeply (more than 32 levels)")
    if isinstance(v, Mapping):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ValidationError(where, f"key {k!r} is not a string")
            _check_str(f"{where} key", k, Rule(max_len=JSON_KEY_MAX))
            _check_json(f"{where}.{k}", x, depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_json(f"{where}[{i}]", x, depth + 1)
    elif isinstance(v, float) and not math.isfinite(v):
        raise ValidationError(where, f"not finite ({v})")
    elif isinstance(v, int) and not isinstance(v, bool):
        check_number(where, v, Rule())
    elif isinstance(v, str):
        check_text(where, v)
    elif not (v is None or isinstance(v, (bool, int, float))):
        raise ValidationError(where, f"not a JSON value ({type(v).__name__})")


SAMPLE_FIELDS = ("prompt", "response", "verdict", "reward", "gold", "error_type")
SAMPLE_ERROR_TYPE_MAX = 64  # a short name (LowCardinality in the store)


def _check_samples(where: str, v: Any) -> None:
    if not isinstance(v, tuple):
        raise ValidationError(where, f"not a list ({type(v).__name__})")
    if len(v) > SAMPLES_MAX:
        raise ValidationError(where, f"more than {SAMPLES_MAX} samples ({len(v)})")
    for i, s in enumerate(v):
        at = f"{where}[{i}]"
        if not isinstance(s, Mapping):
            raise ValidationError(at, f"not an object ({type(s).__name__})")
        unknown = sorted(set(s) - set(SAMPLE_FIELDS), key=str)
        if unknown:
            raise ValidationError(at, f"unknown field {_short(str(unknown[0]))!r} (expected {', '.join(SAMPLE_FIELDS)})")
        for name in ("prompt", "response", "gold"):
            _check_str(f"{at}.{name}", s.get(name, ""), Rule(max_len=SAMPLE_TEXT_MAX))
        _check_str(f"{at}.error_type", s.get("error_type", ""), Rule(max_len=SAMPLE_ERROR_TYPE_MAX))
        verdict = s.get("verdict")
        if verdict is not None and (not is_int(verdict) or verdict not in (0, 1)):
            raise ValidationError(f"{at}.verdict", f"must be 0 or 1 (got {verdict!r})")
        reward = s.get("reward")
        if reward is not None:
            if not is_number(reward):
                raise ValidationError(f"{at}.reward", f"not a number ({type(reward).__name__})")
            check_number(f"{at}.reward", reward, Rule())
