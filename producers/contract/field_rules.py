"""The rules of the event fields, as msgspec constraints, and the checks msgspec cannot express.

`areal_metrics.producers.contract.events` declares the records with the types below: msgspec
checks types, ranges, lengths and choices (in C, on decoding and on construction); this module
adds the rules it has no word for (storage-safe text, nested JSON, evaluation sample rows) and
turns msgspec's errors into ours, so that every reader refuses bad input with an error naming
the field (`ValidationError`: ``<table>.<field>: <rule>``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from areal_metrics.producers.contract.errors import UserError

METRIC_NAME_MAX = 256  # a `metrics` name: 1..256 chars
MESSAGE_MAX = 4096  # chars of a free-text field: an alert's message, a command's reason, an ack's detail, a dead letter's reason
CUT_MARK = " …(cut)"
SAMPLE_TEXT_MAX = 4096  # an eval sample's prompt or response: chars kept (the client truncates)
SAMPLES_MAX = 64  # eval samples per event (the client keeps the first ones)
METRICS_MAX = 1024  # `metrics` names per event (the client keeps the first ones)
NON_FINITE_MAX = 1024  # names in a step's `non_finite` (the client keeps the first ones)
JSON_KEY_MAX = 256  # a key of a free-form object (config, args): chars
JSON_DEPTH_MAX = 32  # nesting of a free-form object

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # an integer field: what an Int64 column holds (msgspec's bounds)
UINT64_MAX = 2**64 - 1  # a number inside nested JSON: what Int64 and UInt64 columns hold between them
FLOAT_MAX = 1.7976931348623157e308  # the largest finite double: bounds that refuse NaN and +-inf
# A number a trainer sends (a step's or an eval's values, `metrics`): at most this large, so that
# what the worker derives from them (sums over a window, squares, a slope, weights by n_samples
# up to 2**63) stays finite; nothing measured in training comes near it.
NUMBER_MAX = 1e100
UINT32_MAX = 2**32 - 1  # rank, votes, window...: UInt32 columns
# `ts`, seconds since the epoch: up to 2106-02-07, which DateTime64(3) columns hold (to 2299)
TS_MAX = float(2**32 - 1)


class ValidationError(UserError, ValueError):
    """Input that breaks the contract. `str(err)` is ``<table>.<field>: <rule>``."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


# ---------------------------------------------------------------- field types
#
# Every number is finite and fits a column; the bounds of a field narrow these.


def Int(ge: int = INT64_MIN, le: int = INT64_MAX) -> Any:  # noqa: N802 - a type
    return Annotated[int, Meta(ge=ge, le=le)]


def Float(ge: float = -FLOAT_MAX, le: float = FLOAT_MAX) -> Any:  # noqa: N802 - a type
    return Annotated[float, Meta(ge=ge, le=le)]


def Text(max_len: int | None = None, nonempty: bool = False, pattern: str | None = None) -> Any:  # noqa: N802
    """A string; storage-safe (no NUL, no lone surrogate) by `check_texts`, which msgspec cannot
    do without a regular expression per string (five times the cost of decoding a step)."""
    return Annotated[str, Meta(min_length=1 if nonempty else None, max_length=max_len, pattern=pattern)]


def number_bounds(cls: type[msgspec.Struct]) -> dict[str, tuple[float, float]]:
    """(least, greatest) value of each number field of a record (an optional one's number), read
    from its type: what a writer that fits values to the fields needs, stated once, in the types."""
    out: dict[str, tuple[float, float]] = {}
    for f in msgspec.inspect.type_info(cls).fields:
        kinds = f.type.types if isinstance(f.type, msgspec.inspect.UnionType) else (f.type,)
        numbers = [t for t in kinds if isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType))]
        if len(numbers) == 1 and numbers[0].ge is not None and numbers[0].le is not None:
            out[f.name] = (numbers[0].ge, numbers[0].le)
    return out


MetricName = Text(METRIC_NAME_MAX, nonempty=True)
Measured = Float(-NUMBER_MAX, NUMBER_MAX)  # a number a trainer sends
Metrics = Annotated[dict[MetricName, Measured], Meta(max_length=METRICS_MAX)]  # named numbers within NUMBER_MAX
DerivedMetrics = Annotated[dict[MetricName, Float()], Meta(max_length=METRICS_MAX)]  # the worker's: finite
JsonObject = dict[str, Any]  # nested JSON (config, args): `check_json`
Samples = Annotated[tuple[dict[str, Any], ...], Meta(max_length=SAMPLES_MAX)]  # `check_samples`


# ---------------------------------------------------------------- storage-safe text
#
# One rule for every string a reader takes (fields, list entries, `metrics` names, the keys
# and strings of config/args, sample text): what ClickHouse's String columns and Kafka keys
# hold as UTF-8. A lone surrogate (the JSON escape "\ud800" decodes to one) cannot be
# encoded as UTF-8, so no insert could ever store it; NUL ends a string for C clients and
# tools reading the tables. Invalid UTF-8 bytes never reach here: the JSON decoder refuses
# them. Bidi controls and 4-byte characters are valid text and are stored as they are.


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


def fit_message(text: str, limit: int = MESSAGE_MAX) -> str:
    """`text` within `limit` characters, a longer one cut with a mark that says so: what the worker and the
    client write into a free-text field (an alert's message built from a user's error text must not
    make the alert, or the event behind it, fail its own rule)."""
    return text if len(text) <= limit else text[: limit - len(CUT_MARK)] + CUT_MARK


def storage_safe(v: str) -> str:
    """`v` with each NUL and lone surrogate replaced by U+FFFD: the client's normalisation of a
    name or text it was given (readers refuse such text instead, to the dead-letter topic)."""
    if text_problem(v) is None:
        return v
    return "".join("\ufffd" if c == "\x00" or "\ud800" <= c <= "\udfff" else c for c in v)


def _holds_text(t: msgspec.inspect.Type) -> bool:
    """A string, a tuple of strings, a map with string keys and number values (`metrics`), or
    either or None. Literal choices hold only their own values; nested JSON and sample rows
    have checks of their own."""
    if isinstance(t, msgspec.inspect.UnionType):
        return any(_holds_text(x) for x in t.types)
    if isinstance(t, msgspec.inspect.StrType):
        return True
    if isinstance(t, msgspec.inspect.VarTupleType):
        return isinstance(t.item_type, msgspec.inspect.StrType)
    return isinstance(t, msgspec.inspect.DictType) and isinstance(t.value_type, msgspec.inspect.FloatType)


def text_fields(cls: type) -> tuple[str, ...]:
    """The fields of record class `cls` that `check_texts` reads, from its declared types."""
    return tuple(f.name for f in msgspec.inspect.type_info(cls).fields if _holds_text(f.type))


def check_texts(where: str, names: tuple[str, ...], values: tuple[Any, ...]) -> None:
    """Every string of `values` (each a string, None, a tuple of strings or a mapping with
    string keys; `names` says whose) storage-safe, in one pass over their concatenation; only
    a failing record is walked again to name the field."""
    parts: list[str] = []
    for v in values:
        if type(v) is str:
            parts.append(v)
        elif v:
            parts.extend(v)  # a tuple's entries, a mapping's keys
    blob = "".join(parts)
    if ("\x00" not in blob and blob.isascii()) or text_problem(blob) is None:
        return
    for name, v in zip(names, values):
        if type(v) is str:
            check_text(f"{where}.{name}", v)
        elif v:
            for i, s in enumerate(v):
                check_text(f"{where}.{name} key" if isinstance(v, Mapping) else f"{where}.{name}[{i}]", s)


# ---------------------------------------------------------------- nested values


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_number(where: str, v: Any) -> None:
    """A number a column holds: a finite float, an integer within 64 bits."""
    if isinstance(v, int):
        if not INT64_MIN <= v <= UINT64_MAX:  # math on such ints overflows floats; no column holds them
            raise ValidationError(where, f"integer out of the 64-bit range ({len(str(abs(v)))} digits)")
    elif not math.isfinite(v):
        raise ValidationError(where, f"not finite ({v})")


def _short(v: str, n: int = 40) -> str:
    return v if len(v) <= n else v[:n] + "..."


def check_json(where: str, v: Any, depth: int = 0) -> None:
    """Nested JSON (a config, a command's args): string keys, finite numbers, storage-safe
    text, bounded depth."""
    if depth > JSON_DEPTH_MAX:
        raise ValidationError(where, f"nested too deeply (more than {JSON_DEPTH_MAX} levels)")
    if isinstance(v, Mapping):
        for k, x in v.items():
            if not isinstance(k, str):
                raise ValidationError(where, f"key {k!r} is not a string")
            if len(k) > JSON_KEY_MAX:
                raise ValidationError(f"{where} key", f"longer than {JSON_KEY_MAX} chars ({len(k)})")
            check_text(f"{where} key", k)
            check_json(f"{where}.{k}", x, depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            check_json(f"{where}[{i}]", x, depth + 1)
    elif isinstance(v, str):
        check_text(where, v)
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
        check_number(where, v)
    elif not (v is None or isinstance(v, bool)):
        raise ValidationError(where, f"not a JSON value ({type(v).__name__})")


SAMPLE_FIELDS = ("prompt", "response", "verdict", "reward", "gold", "error_type")
SAMPLE_ERROR_TYPE_MAX = 64  # a short name (LowCardinality in the store)
_SAMPLE_TEXT = {"prompt": SAMPLE_TEXT_MAX, "response": SAMPLE_TEXT_MAX, "gold": SAMPLE_TEXT_MAX,
                "error_type": SAMPLE_ERROR_TYPE_MAX}


def check_samples(where: str, samples: tuple[Any, ...]) -> None:
    """Evaluation sample rows (the generations table): known fields, bounded storage-safe text,
    a 0/1 verdict, a finite reward."""
    for i, s in enumerate(samples):
        at = f"{where}[{i}]"
        unknown = sorted(set(s) - set(SAMPLE_FIELDS), key=str)
        if unknown:
            raise ValidationError(at, f"unknown field {_short(str(unknown[0]))!r} (expected {', '.join(SAMPLE_FIELDS)})")
        for name, longest in _SAMPLE_TEXT.items():
            v = s.get(name, "")
            if not isinstance(v, str):
                raise ValidationError(f"{at}.{name}", f"not a string ({type(v).__name__})")
            if len(v) > longest:
                raise ValidationError(f"{at}.{name}", f"longer than {longest} chars ({len(v)})")
            check_text(f"{at}.{name}", v)
        verdict = s.get("verdict")
        if verdict is not None and (not is_int(verdict) or verdict not in (0, 1)):
            raise ValidationError(f"{at}.verdict", f"must be 0 or 1 (got {verdict!r})")
        reward = s.get("reward")
        if reward is not None:
            if not is_number(reward):
                raise ValidationError(f"{at}.reward", f"not a number ({type(reward).__name__})")
            check_number(f"{at}.reward", reward)


# ---------------------------------------------------------------- msgspec's errors, in our words

_AT = re.compile(r"^(?P<problem>.*?) - at `(?P<path>[^`]*)`(?: in `(?P<outer>[^`]*)`)?$", re.S)
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`(?: - at `(?P<path>[^`]*)`)?$")
_OURS = re.compile(r"^(?P<where>[\w.\[\]@/ -]+?): (?P<problem>.*)$", re.S)
_NOUNS = {"int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean", "object": "an object",
          "array": "a list", "null": "null"}
_REWORDED = (  # msgspec's wording, in ours (the bounds every number has first)
    (re.compile(r"^Expected `float` (>=|<=) -?1\.7976931348623157e\+308$"), lambda m: "not finite"),
    (re.compile(r"^Number out of range$"), lambda m: "not finite (beyond the float range)"),
    (re.compile(r"^Expected `float` (>=|<=) -?1e\+100$"), lambda m: f"not finite or beyond +-{NUMBER_MAX:g} (the number range)"),
    (re.compile(r"^Expected `int` (>= -9223372036854775808|<= 9223372036854775807)$"),
     lambda m: "integer out of the 64-bit range"),
    (re.compile(r"^Expected `(?:int|float)` (>=|<=|>|<) (\S+)$"), lambda m: f"must be {m[1]} {m[2]}"),
    (re.compile(r"^Expected `(\w+)(?: \| null)?`, got `(\w+)`$"), lambda m: f"not {_NOUNS.get(m[1], m[1])} ({m[2]})"),
    (re.compile(r"^Expected `str` of length >= 1$"), lambda m: "must not be empty"),
    (re.compile(r"^Expected `str` of length <= (\d+)$"), lambda m: f"longer than {m[1]} chars"),
    (re.compile(r"^Expected `array` of length <= (\d+)$"), lambda m: f"more than {m[1]} entries"),
    (re.compile(r"^Expected `object` of length <= (\d+)$"), lambda m: f"more than {m[1]} names"),
    (re.compile(r"^Expected `str` matching regex '\^\(\?:(.*)\)\$'$"), lambda m: f"does not match {m[1]}"),
    (re.compile(r"^Invalid enum value (.*)$"), lambda m: f"{m[1]} is not an allowed value"),
)


def _choices(cls: type, path: str) -> tuple[str, ...]:
    """The allowed values of the Literal field at `path` (``$.stage``) of `cls`, else ()."""
    name = path[2:] if path.startswith("$.") else ""
    for f in msgspec.inspect.type_info(cls).fields:
        if f.name == name:
            t = f.type
            kinds = t.types if isinstance(t, msgspec.inspect.UnionType) else (t,)
            return next((tuple(map(str, k.values)) for k in kinds if isinstance(k, msgspec.inspect.LiteralType)), ())
    return ()


def from_msgspec(cls: type, exc: msgspec.ValidationError) -> ValidationError:
    """msgspec's ``<problem> - at `$.field[3]``` as ``<table>.field[3]: <problem>`` (`cls`: the
    record class, whose `table` names it); an error raised by a record's own checks (already
    ours) as it was."""
    table = cls.table  # type: ignore[attr-defined]
    text = str(exc)
    missing = _MISSING.match(text)
    if missing:
        path = (missing["path"] or "$")[1:]
        return ValidationError(f"{table}{path}.{missing['name']}", "missing")
    found = _AT.match(text)
    if found is None:
        ours = _OURS.match(text)
        if ours:
            return ValidationError(ours["where"], ours["problem"])
        return ValidationError(table, text)
    problem = found["problem"]
    choices = _choices(cls, found["path"]) if problem.startswith("Invalid enum value") else ()
    if choices:
        problem = f"{problem.removeprefix('Invalid enum value ')} is not one of {', '.join(choices)}"
    for pattern, words in _REWORDED:
        reworded = pattern.match(problem)
        if reworded:
            problem = words(reworded)
            break
    if found["outer"] is not None:  # `key` in `$.metrics`: a mapping's key
        return ValidationError(f"{table}{found['outer'][1:]} key", problem)
    return ValidationError(f"{table}{found['path'][1:]}", problem)
