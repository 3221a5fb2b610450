"""Values as training code hands them over -> values the contract accepts (pure).

Nothing here raises for a value; what cannot be stored is reported back so
the client can name it. The rules:

- numbers: Python int/float/bool, numpy scalars, 0-d (or one-element) torch
  tensors and numpy arrays (duck-typed: `.item()`, never an import of torch),
  anything with `__float__` (Decimal, Fraction). Anything else (strings, lists,
  multi-element tensors) is not a number and is skipped. `None` is skipped.
- NaN, +-inf and numbers beyond +-1e100 (NUMBER_MAX: what the worker's arithmetic keeps finite)
  become null and their names go into `non_finite`.
- A typed column gets its value when the value meets the column's rule; a
  value a hair outside (within 1e-6, e.g. clip_ratio 1.0000001, lr -1e-12) is
  clamped to the bound; a value clearly outside (clip_ratio 1.5, lr -0.1) stays
  in `metrics` under the name it was logged with, and the column stays null.
- Count columns (tokens, gpu_mem_bytes, n_samples) are rounded to integers.
- `epoch` may be fractional; a negative one stays in `metrics`, a NaN one is
  named in `non_finite`; either way the step keeps the previous epoch.
- `metrics` names: cut to 256 characters; an empty name is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from areal_metrics.producers.client.aliases import ALIASES, BOUNDS, INT_COLUMNS
from areal_metrics.producers.contract.field_rules import (
    JSON_DEPTH_MAX,
    JSON_KEY_MAX,
    NUMBER_MAX,
    METRIC_NAME_MAX,
    METRICS_MAX,
    NON_FINITE_MAX,
    SAMPLE_ERROR_TYPE_MAX,
    SAMPLE_TEXT_MAX,
    SAMPLES_MAX,
    storage_safe,
)
from areal_metrics.producers.contract.limits import default_limits

TOLERANCE = 1e-6  # how far outside a column's bound a value is still clamped (relative, at least absolute)
INT64 = (-(2**63), 2**63 - 1)
CONFIG_MAX_BYTES = 256 * 1024  # a run's config, as JSON; larger values are replaced by a note


# ----------------------------------------------------------------- one number


def to_number(v: Any) -> int | float | None:
    """A Python int or float for anything that is one number; None otherwise (never raises)."""
    t = type(v)
    if t is float or t is int:
        return v
    return _read_one(_kind_of(t), v)


# How the values of a type are read, learnt once per type: "plain" (Python int or float),
# "int", "float" (their subclasses: bool, IntEnum, numpy.float64), "numpy" (numpy scalars:
# a step's many are read in one array), "item" (tensors, numpy arrays: `.item()`), "dunder"
# (`__float__`: Decimal, Fraction), "nested" (a dict or other mapping: its values go in under
# `name/key`, `snapshot`), "none" (not a number).
_KINDS: dict[type, str] = {float: "plain", int: "plain", str: "none", bytes: "none", complex: "none",
                           type(None): "none", dict: "nested"}
NESTED_MAX = 4  # levels of dicts in dicts flattened by `log` (`{"a": {"b": 1}}` is two); deeper ones are skipped


def _kind_of(t: type) -> str:
    kind = _KINDS.get(t)
    if kind is None:
        if issubclass(t, int):
            kind = "int"
        elif issubclass(t, float):
            kind = "float"
        elif "numpy" in sys.modules and issubclass(t, sys.modules["numpy"].generic):
            kind = "numpy"  # (a numpy scalar exists only once numpy is imported)
        elif issubclass(t, Mapping):
            kind = "nested"
        elif callable(getattr(t, "item", None)):
            kind = "item"
        elif hasattr(t, "__float__"):
            kind = "dunder"
        else:
            kind = "none"
        _KINDS[t] = kind
    return kind


def _number(x: Any) -> int | float | None:
    """What `.item()` gave, as a contract number (a bool as an int; a complex, a date: None)."""
    t = type(x)
    if t is float or t is int:
        return x
    return int(x) if t is bool else None


def _read_one(kind: str, v: Any) -> int | float | None:
    if kind == "plain":
        return v  # type: ignore[no-any-return]
    if kind == "int":
        return int(v)
    if kind == "float":
        return float(v)
    if kind in ("numpy", "item"):
        try:
            return _number(v.item())
        except Exception:  # noqa: BLE001 - a multi-element tensor, a device error: not one number
            return None
    if kind == "dunder":
        try:
            return float(v)
        except Exception:  # noqa: BLE001
            return None
    return None


def _read_many(kind: str, t: type, vs: list[Any]) -> list[int | float | None]:
    """The values `vs`, all of type `t`, read at once where the kind allows it."""
    try:
        if kind == "numpy":  # one array of the type's dtype: its tolist() is each scalar's item()
            read = sys.modules["numpy"].array(vs).tolist()
        elif kind == "item":
            read = list(map(t.item, vs))  # type: ignore[attr-defined]
        else:
            return [_read_one(kind, v) for v in vs]
    except Exception:  # noqa: BLE001 - one of them is not one number: each on its own
        return [_read_one(kind, v) for v in vs]
    return read if set(map(type, read)) <= _PLAIN_TYPES else [_number(x) for x in read]


_PLAIN_TYPES = {float, int}
# Kinds whose values cannot change after `log` returns (numbers, numpy scalars, strings, None):
# `snapshot` keeps them as given and the sender thread reads them (`numbers`).
_SETTLED_KINDS = ("plain", "int", "float", "numpy", "none")
_SETTLED: set[type] = {t for t, kind in _KINDS.items() if kind in _SETTLED_KINDS}


def snapshot(values: Mapping[Any, Any], depth: int = 1) -> dict[Any, Any]:
    """The caller-thread part of `log`: a copy of the values in which each one that may change later is read now.

    A tensor or an array is read now (`.item()`), because the training loop may
    change it in place after `log` returns; so is an object read by `__float__`.
    Numbers, numpy scalars, strings and None cannot change: they are kept as
    given, and the sender thread reads or skips them (`numbers`). A value that
    cannot be read now (a multi-element tensor) is kept too, and skipped there.
    A dict (any mapping) is flattened, as W&B users write `{"train": {"loss": x}}`:
    its values go in under `train/loss`, read the same way, down to `NESTED_MAX`
    levels (a deeper one is kept as it is, and skipped and named by the sender).
    """
    out = dict(values)
    settled = _SETTLED
    if settled.issuperset(map(type, out.values())):
        return out
    nested: list[Any] = []
    reading = read = None  # the type read last, and how (a step's tensors come one after another)
    for k, v in out.items():  # values are replaced in place: the keys do not change
        t = type(v)
        if t is not reading:
            if t in settled:
                continue
            kind = _kind_of(t)
            if kind in _SETTLED_KINDS:
                settled.add(t)
                continue
            if kind == "nested":
                nested.append(k)
                continue
            reading, read = t, (t.item if kind == "item" else float)
        try:
            out[k] = read(v)
        except Exception:  # noqa: BLE001 - not one number (a multi-element tensor): kept, the sender skips it
            pass
    if nested and depth < NESTED_MAX:
        _flatten(out, nested, depth)
    return out


def _flatten(out: dict[Any, Any], keys: list[Any], depth: int) -> None:
    """Each mapping under `keys` replaced in `out` by its values, named `key/inner` (read as `snapshot` reads)."""
    for k in keys:
        inner = out.pop(k)
        try:
            flat = {f"{k}/{name}": v for name, v in inner.items()}
        except Exception:  # noqa: BLE001 - a mapping whose items() fails: kept, the sender skips and names it
            out[k] = inner
            continue
        out.update(snapshot(flat, depth + 1))


def numbers(values: Mapping[Any, Any]) -> tuple[dict[Any, int | float], tuple[Any, ...]]:
    """A step's values (from `snapshot`) as Python numbers only, and the names skipped (the sender thread's part).

    Plain floats and ints (the common case) are copied as they are, at C
    speed. Values of one type are read together (numpy scalars as one array).
    `None` is skipped without being named.
    """
    out = dict(values)
    if _PLAIN_TYPES.issuperset(map(type, out.values())):
        return out, ()
    by_type: dict[type, list[Any]] = {}
    for k, v in out.items():
        t = type(v)
        if t is not float and t is not int:
            keys = by_type.get(t)
            if keys is None:
                by_type[t] = [k]
            else:
                keys.append(k)
    skipped = set()
    for t, keys in by_type.items():
        given = [out[k] for k in keys]
        read = _read_many(_kind_of(t), t, given)
        if None not in read:
            out.update(zip(keys, read))
            continue
        for k, v, x in zip(keys, given, read):
            if x is None:
                del out[k]
                if v is not None:
                    skipped.add(k)
            else:
                out[k] = x
    return out, tuple(k for k in values if k in skipped) if skipped else ()


def finite(v: int | float) -> bool:
    if type(v) is int:
        return True
    return v - v == 0.0  # NaN and +-inf give NaN


def as_float(v: int | float) -> float | None:
    """float(v), or None for a value the contract refuses: not finite, or beyond +-NUMBER_MAX (an
    int too large for a float included)."""
    try:
        x = float(v)
    except OverflowError:
        return None
    return x if x - x == 0.0 and -NUMBER_MAX <= x <= NUMBER_MAX else None


def metric_name(key: Any) -> str:
    """The name a key is sent under ("" for a key whose str() raises: skipped)."""
    if type(key) is str:
        return storage_safe(key[:METRIC_NAME_MAX])
    try:
        return storage_safe(str(key)[:METRIC_NAME_MAX])
    except Exception:  # noqa: BLE001 - never raise for a value
        return ""


# ------------------------------------------------------------------- a step


@dataclass(slots=True)
class StepParts:
    """What one step's values become: typed columns, metrics, the non-finite names, the epoch."""

    columns: dict[str, int | float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    non_finite: list[str] = field(default_factory=list)
    epoch: float = 0.0
    dropped: int = 0  # metrics names past the cap, not sent
    beyond: int = 0  # finite values beyond +-NUMBER_MAX (sent as null, named in non_finite)


def clamp(x: float, lo: float | None, hi: float | None) -> float | None:
    """x within [lo, hi]; a value a hair outside (TOLERANCE) is moved onto the bound, one further out gives None."""
    if lo is not None and x < lo:
        if lo - x > TOLERANCE * max(1.0, abs(lo)):
            return None
        x = lo
    if hi is not None and x > hi:
        if x - hi > TOLERANCE * max(1.0, abs(hi)):
            return None
        x = hi
    return x


def fit_column(column: str, x: float) -> int | float | None:
    """The value for a typed column (clamped when a hair outside its bound), or None when it breaks the rule."""
    fitted = clamp(x, *BOUNDS.get(column, (None, None)))
    if fitted is None:
        return None
    if column in INT_COLUMNS:
        n = round(fitted)
        return n if INT64[0] <= n <= INT64[1] else None
    return float(fitted)


def split_step(values: Mapping[Any, int | float], previous_epoch: float = 0.0,
               max_metrics: int = METRICS_MAX) -> StepParts:
    """A step's numbers (from `numbers`) -> typed columns and metrics (the sender thread's part);
    of the metrics, the first `max_metrics` names logged are kept and the rest counted in `dropped`."""
    parts = StepParts(epoch=previous_epoch)
    holders: dict[str, tuple[int, str, float | None]] = {}  # column -> (priority, name, value as logged; None: NaN)
    nan: list[tuple[str, str | None]] = []  # (name as logged, the column it would have filled)
    for key, v in values.items():
        name = metric_name(key)
        if not name:
            continue
        alias = ALIASES.get(name)
        x = as_float(v)
        if x is None:
            if v - v == 0:  # finite, and beyond the number range
                parts.beyond += 1
            nan.append((name, alias[0] if alias is not None else None))
            if alias is not None and alias[2] == 0:  # the own name given as NaN: no alias may fill its column
                held = holders.get(alias[0])
                if held is not None:
                    parts.metrics[held[1]] = held[2]
                    del parts.columns[alias[0]]
                holders[alias[0]] = (0, name, x)
            continue
        if name == "epoch":
            if x >= 0:
                parts.epoch = x
            else:
                parts.metrics[name] = x
            continue
        if alias is None:
            parts.metrics[name] = x
            continue
        column, factor, rank = alias
        fitted = fit_column(column, x * factor)
        held = holders.get(column)
        if fitted is None or (held is not None and held[0] <= rank):
            parts.metrics[name] = x  # breaks the column's rule, or the column already has a better name's value
            continue
        if held is not None:  # a lesser alias filled it first: it moves to metrics
            parts.metrics[held[1]] = held[2]
        parts.columns[column] = fitted
        holders[column] = (rank, name, x)
    # a NaN names the column it leaves null; when another name filled that column, the NaN is that name's
    names = (column if column is not None and column not in holders else name for name, column in nan)
    parts.non_finite = list(dict.fromkeys(names))[:NON_FINITE_MAX]  # readers refuse more
    cap = min(max_metrics, METRICS_MAX)  # readers refuse more than METRICS_MAX
    if len(parts.metrics) > cap:  # the first names logged are kept
        parts.dropped = len(parts.metrics) - cap
        parts.metrics = dict(list(parts.metrics.items())[:cap])
    return parts


# ------------------------------------------------------------- evaluations


def verdict(v: Any) -> int:
    """1 for a correct sample: True, 1, a positive reward; 0 otherwise (NaN and non-numbers included)."""
    x = to_number(v)
    if x is None:
        return 0
    return 1 if finite(x) and x > 0 else 0


def verdicts(values: Any) -> list[int]:
    """A list, tuple, numpy array or tensor of verdicts -> [0/1, ...]."""
    tolist = getattr(values, "tolist", None)
    if callable(tolist) and not isinstance(values, (list, tuple)):
        try:
            values = tolist()
        except Exception:  # noqa: BLE001
            return []
    if not isinstance(values, Iterable) or isinstance(values, (str, bytes, Mapping)):
        return []
    return [verdict(v) for v in values]


def text(v: Any) -> str:
    if isinstance(v, str):
        return storage_safe(v[:SAMPLE_TEXT_MAX])
    return "" if v is None else text_of(v, SAMPLE_TEXT_MAX)


def samples(values: Any) -> tuple[list[dict[str, Any]], int]:
    """Eval samples -> at most SAMPLES_MAX records {prompt, response, verdict, reward, gold, error_type};
    and how many were cut (gold and error_type only when given).

    A record is a mapping (or an object with those attributes); other keys are
    dropped, text is cut to SAMPLE_TEXT_MAX characters, a non-finite reward is null.
    """
    if values is None or isinstance(values, (str, bytes)):
        return [], 0
    items = list(values) if isinstance(values, Iterable) else []
    out = []
    for s in items[:SAMPLES_MAX]:
        get = s.get if isinstance(s, Mapping) else (lambda k, d=None, s=s: getattr(s, k, d))
        record: dict[str, Any] = {"prompt": text(get("prompt")), "response": text(get("response"))}
        if get("verdict") is not None:
            record["verdict"] = verdict(get("verdict"))
        reward = to_number(get("reward"))
        if reward is not None and as_float(reward) is not None:
            record["reward"] = float(reward)
        for name, cap in (("gold", SAMPLE_TEXT_MAX), ("error_type", SAMPLE_ERROR_TYPE_MAX)):
            if get(name) is not None:
                record[name] = text(get(name))[:cap]
        out.append(record)
    return out, max(0, len(items) - SAMPLES_MAX)


def float_metrics(values: Mapping[Any, Any]) -> tuple[dict[str, float], list[str]]:
    """Extra eval metrics (pass@4, ...): finite floats kept, the names of the rest returned."""
    out, dropped = {}, []
    for k, v in values.items():
        name = metric_name(k)
        x = to_number(v)
        f = None if x is None else as_float(x)
        if not name or f is None or (name not in out and len(out) >= METRICS_MAX):
            dropped.append(name or repr(k))
            continue
        out[name] = f
    return out, dropped


# ------------------------------------------------------------------- config


CONFIG_DEPTH_MAX = JSON_DEPTH_MAX - 2  # a config's nesting the client keeps (readers refuse deeper: check_json)
# What `config` did to a value it could not send as it was, by kind: init() warns once for each.
CONFIG_NOTES = {
    "deep": f"nested deeper than {CONFIG_DEPTH_MAX} levels: the deeper values are replaced by a note",
    "keys": "an object with more names than a message may hold: the first ones are kept",
    "items": "a list with more entries than a message may hold: the first ones are kept",
    "unreadable": "a value that could not be read (its conversion raised): replaced by a note",
    "big": f"larger than {CONFIG_MAX_BYTES} bytes as JSON: its largest top-level values are replaced by a note",
}


def text_of(v: Any, limit: int) -> str:
    """str(v) cut to `limit`, or a note when str() itself fails (a recursion, a broken __str__)."""
    try:
        return storage_safe(str(v)[:limit])
    except Exception:  # noqa: BLE001 - never raise for a value
        return f"<unprintable {type(v).__name__[:64]}>"


def json_safe(v: Any, depth: int = 0, notes: set[str] | None = None) -> Any:
    """A config (dict, dataclass, argparse.Namespace, pydantic or OmegaConf object...) as plain JSON values,
    within the readers' structure limits; what had to change is named in `notes` (CONFIG_NOTES' kinds)."""
    notes = set() if notes is None else notes
    try:
        return _json_safe(v, depth, notes)
    except Exception as exc:  # noqa: BLE001 - e.g. a mapping whose items() raises
        notes.add("unreadable")
        return f"<unreadable {type(v).__name__[:64]}: {text_of(exc, 200)}>"


def _json_safe(v: Any, depth: int, notes: set[str]) -> Any:
    if isinstance(v, str):
        return storage_safe(v)
    if v is None or isinstance(v, bool):
        return v
    if type(v) is int or type(v) is float:
        return v if finite(v) and (type(v) is float or INT64[0] <= v <= INT64[1]) else str(v)
    if depth > CONFIG_DEPTH_MAX:
        notes.add("deep")
        return f"<nested deeper than {CONFIG_DEPTH_MAX} levels: not stored>"
    limits = default_limits()
    if isinstance(v, Mapping):
        items = list(islice(v.items(), limits.max_keys + 1))
        if len(items) > limits.max_keys:
            notes.add("keys")
            items = items[:limits.max_keys]
        return {text_of(k, JSON_KEY_MAX): json_safe(x, depth + 1, notes) for k, x in items}
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: json_safe(getattr(v, f.name, None), depth + 1, notes) for f in dataclasses.fields(v)}
    if isinstance(v, argparse.Namespace):
        return json_safe(vars(v), depth, notes)
    for method in ("model_dump", "to_dict"):  # pydantic, HF TrainingArguments
        dump = getattr(v, method, None)
        if callable(dump) and not isinstance(v, type):
            try:
                dumped = dump()
            except Exception:  # noqa: BLE001
                break
            return json_safe(dumped, depth + 1, notes)
    if isinstance(v, (list, tuple, set, frozenset)):
        entries = list(islice(v, limits.max_items + 1))
        if len(entries) > limits.max_items:
            notes.add("items")
            entries = entries[:limits.max_items]
        return [json_safe(x, depth + 1, notes) for x in entries]
    x = to_number(v)
    if x is not None:
        return json_safe(x, depth, notes)
    return text_of(v, 10_000)


def config(v: Any) -> dict[str, Any]:
    """A run's config as a JSON object of bounded size (top-level values too large are replaced by a note)."""
    return config_with_notes(v)[0]


def config_with_notes(v: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
    """`config(v)`, and the kinds of change it made (CONFIG_NOTES' keys, sorted); never raises."""
    if v is None:
        return {}, ()
    notes: set[str] = set()
    safe = json_safe(v, 0, notes)
    if not isinstance(safe, dict):
        safe = {"value": safe}
    if len(json.dumps(safe, separators=(",", ":"))) > CONFIG_MAX_BYTES:
        notes.add("big")
        out = {}
        for k, x in safe.items():
            size = len(json.dumps(x, separators=(",", ":")))
            out[k] = x if size <= 4096 else f"<{size} bytes, not stored>"
        safe = out
    return safe, tuple(sorted(notes))
