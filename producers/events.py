"""The event contract: immutable typed records, one class per event type.

Every record validates itself on construction, so an invalid event cannot
exist in memory. Readers turn bytes into records with `parse_event`; the
error it raises names the field and the rule, e.g.
``steps.reward: not finite (nan)``.

Field rules live beside the fields (``rule(...)`` metadata) so the contract in
../shared/CONTRACT.md reads straight off this file.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import socket
import time
import types
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union, get_args, get_origin, get_type_hints

from producers.errors import UserError
from producers.ids import RUN_ID_PATTERN

try:  # compiled JSON for readers (worker, sink); the bare client package does without
    import orjson
except ImportError:
    orjson = None  # type: ignore[assignment]

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # a reader refuses larger messages before parsing them
_HOSTNAME = socket.gethostname()[:128] or "localhost"
METRIC_NAME_MAX = 256  # a `metrics` name: 1..256 chars
SAMPLE_TEXT_MAX = 4096  # an eval sample's prompt or response: chars kept (the client truncates)
SAMPLES_MAX = 64  # eval samples per event (the client keeps the first ones)


class ValidationError(UserError, ValueError):
    """Input that breaks the contract. `str(err)` is ``<table>.<field>: <rule>``."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


def new_event_id() -> str:
    return uuid.uuid4().hex


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


def _checks(cls: type) -> tuple[_Check, ...]:
    found = _CHECKS.get(cls)
    if found is None:
        hints = get_type_hints(cls)
        found = tuple(
            _Check(f.name, *_kind_of(hints[f.name]), f.metadata.get("rule", Rule()))
            for f in dataclasses.fields(cls)
        )
        _CHECKS[cls] = found
    return found


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_INT64 = (-(2**63), 2**64 - 1)  # what Int64 and UInt64 columns hold between them


def _check_number(where: str, v: Any, r: Rule) -> None:
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
    if r.choices is not None and v not in r.choices:
        raise ValidationError(where, f"{_short(v)!r} is not one of {', '.join(r.choices)}")
    if r.pattern is not None and not r.pattern.fullmatch(v):
        raise ValidationError(where, f"{_short(v)!r} does not match {r.pattern.pattern}")


def _short(v: str, n: int = 40) -> str:
    return v if len(v) <= n else v[:n] + "..."


def _check_value(where: str, c: _Check, v: Any) -> None:
    kind, r = c.kind, c.rule
    if kind == "int":
        if not _is_int(v):
            raise ValidationError(where, f"not an integer ({type(v).__name__})")
        _check_number(where, v, r)
    elif kind == "float":
        if not _is_number(v):
            raise ValidationError(where, f"not a number ({type(v).__name__})")
        _check_number(where, v, r)
    elif kind == "str":
        _check_str(where, v, r)
    elif kind == "bool":
        if not isinstance(v, bool):
            raise ValidationError(where, f"not a boolean ({type(v).__name__})")
    elif kind == "int_list":
        if not isinstance(v, tuple):
            raise ValidationError(where, f"not a list ({type(v).__name__})")
        for i, x in enumerate(v):
            if not _is_int(x) or x not in (0, 1):
                raise ValidationError(f"{where}[{i}]", f"must be 0 or 1 (got {x!r})")
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
        for k, x in v.items():
            _check_str(f"{where} key", k, Rule(max_len=METRIC_NAME_MAX, nonempty=True))
            if not _is_number(x):
                raise ValidationError(f"{where}.{k}", f"not a number ({type(x).__name__})")
            _check_number(f"{where}.{k}", x, Rule())
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
            _check_json(f"{where}.{k}", x, depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_json(f"{where}[{i}]", x, depth + 1)
    elif isinstance(v, float) and not math.isfinite(v):
        raise ValidationError(where, f"not finite ({v})")
    elif isinstance(v, int) and not isinstance(v, bool):
        _check_number(where, v, Rule())
    elif not (v is None or isinstance(v, (str, bool, int, float))):
        raise ValidationError(where, f"not a JSON value ({type(v).__name__})")


SAMPLE_FIELDS = ("prompt", "response", "verdict", "reward")


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
        for name in ("prompt", "response"):
            _check_str(f"{at}.{name}", s.get(name, ""), Rule(max_len=SAMPLE_TEXT_MAX))
        verdict = s.get("verdict")
        if verdict is not None and (not _is_int(verdict) or verdict not in (0, 1)):
            raise ValidationError(f"{at}.verdict", f"must be 0 or 1 (got {verdict!r})")
        reward = s.get("reward")
        if reward is not None:
            if not _is_number(reward):
                raise ValidationError(f"{at}.reward", f"not a number ({type(reward).__name__})")
            _check_number(f"{at}.reward", reward, Rule())


# --------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """The envelope every event carries (see CONTRACT.md, 'Envelope')."""

    type: ClassVar[str] = ""
    table: ClassVar[str] = ""  # ClickHouse table, also the prefix of error messages

    run_id: str = rule(nonempty=True, max_len=128, pattern=RUN_ID_PATTERN)
    node: str = rule(_HOSTNAME, nonempty=True, max_len=128)
    rank: int = rule(0, ge=0)
    ts: float = rule(factory=time.time, ge=0)
    event_id: str = rule(factory=new_event_id, nonempty=True, max_len=128)
    schema: int = rule(SCHEMA_VERSION, ge=1, le=SCHEMA_VERSION)

    def __post_init__(self) -> None:
        for c in _checks(type(self)):
            v = getattr(self, c.name)
            if v is None:
                if not c.optional:
                    raise ValidationError(f"{self.table}.{c.name}", "missing")
                continue
            if c.kind in ("int_list", "str_list", "sample_list") and isinstance(v, list):
                v = tuple(v)
                object.__setattr__(self, c.name, v)
            elif c.kind in ("float_map", "json_map") and isinstance(v, dict):
                v = types.MappingProxyType(dict(v))
                object.__setattr__(self, c.name, v)
            _check_value(f"{self.table}.{c.name}", c, v)
        self._check_rules()

    def _check_rules(self) -> None:
        """Rules across fields; subclasses add theirs."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        for c in _checks(type(self)):
            v = getattr(self, c.name)
            if v is None:
                continue
            if c.kind in ("int_list", "str_list"):
                v = list(v)
            elif c.kind == "sample_list":
                v = [dict(x) for x in v]
            elif c.kind in ("float_map", "json_map"):
                v = dict(v)
            out[c.name] = v
        return out

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), allow_nan=False, separators=(",", ":")).encode()

    def replace(self, **changes: Any) -> Event:
        """A copy with some fields changed; the event_id is kept unless given."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepEvent(Event):
    type: ClassVar[str] = "step"
    table: ClassVar[str] = "steps"

    step: int = rule(ge=0)
    epoch: float = rule(ge=0)  # completed epochs; fractional as HF's `state.epoch`
    reward: float | None = None
    reward_std: float | None = rule(None, ge=0)
    entropy: float | None = None
    advantage_mean: float | None = None
    advantage_std: float | None = rule(None, ge=0)
    kl: float | None = None
    clip_ratio: float | None = rule(None, ge=0, le=1)
    loss: float | None = None
    lr: float | None = rule(None, ge=0)
    grad_norm: float | None = rule(None, ge=0)
    response_length: float | None = rule(None, ge=0)
    tokens: int | None = rule(None, ge=0)
    throughput: float | None = rule(None, ge=0)
    latency_ms: float | None = rule(None, ge=0)
    gpu_mem_bytes: int | None = rule(None, ge=0)
    metrics: Mapping[str, float] = rule(factory=dict)
    world_size: int | None = rule(None, ge=1, le=1 << 20)  # ranks that publish this step
    attempt: int = rule(0, ge=0, le=1 << 20)  # a resumed run publishes with attempt + 1
    non_finite: tuple[str, ...] = rule(factory=tuple, max_len=1024)  # fields/metrics whose NaN/inf is null here
    n_samples: int | None = rule(None, ge=0)  # samples behind this rank's reward: its weight over ranks


EVAL_STATUSES = ("ok", "failed", "skipped")


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalEvent(Event):
    type: ClassVar[str] = "eval"
    table: ClassVar[str] = "evals"

    eval_id: str = rule(nonempty=True, max_len=256)
    step: int = rule(ge=0)
    dataset: str = rule(nonempty=True, max_len=128)
    stage: str = rule("full", choices=("quick", "full"))
    status: str = rule("ok", choices=EVAL_STATUSES)
    accuracy: float | None = rule(None, ge=0, le=1)
    response_length: float | None = rule(None, ge=0)
    reward: float | None = None
    n_samples: int | None = rule(None, ge=0)
    latency_ms: float | None = rule(None, ge=0)
    verdicts: tuple[int, ...] | None = None
    error: str | None = rule(None, max_len=4096)
    replicas: int = rule(1, ge=1, le=4096)
    dataset_fingerprint: str | None = rule(None, nonempty=True, max_len=128)
    metrics: Mapping[str, float] = rule(factory=dict)  # e.g. pass@4, maj@4
    samples: tuple[Mapping[str, Any], ...] | None = None  # {prompt, response, verdict, reward}: the generations table
    attempt: int = rule(0, ge=0, le=1 << 20)

    def _check_rules(self) -> None:
        if self.status == "ok" and self.accuracy is None:
            raise ValidationError("evals.accuracy", "missing (required when status is ok)")
        if self.verdicts is not None and self.n_samples is not None and len(self.verdicts) != self.n_samples:
            raise ValidationError(
                "evals.verdicts", f"has {len(self.verdicts)} entries but n_samples is {self.n_samples}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalConsensusEvent(Event):
    type: ClassVar[str] = "eval_consensus"
    table: ClassVar[str] = "eval_consensus"

    eval_id: str = rule(nonempty=True, max_len=256)
    step: int = rule(ge=0)
    dataset: str = rule(nonempty=True, max_len=128)
    stage: str = rule("full", choices=("quick", "full"))
    accuracy: float = rule(ge=0, le=1)
    response_length: float | None = rule(None, ge=0)
    votes: int = rule(ge=0)
    replicas: int = rule(ge=1)
    agreement: float = rule(ge=0, le=1)
    dissenters: tuple[str, ...] = rule(factory=tuple)
    stale: bool = False
    partial: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RewardSmoothedEvent(Event):
    type: ClassVar[str] = "reward_smoothed"
    table: ClassVar[str] = "rewards_smoothed"

    step: int = rule(ge=0)
    reward: float
    window: int = rule(ge=1)
    sliding_avg: float
    ema: float
    slope: float


COMMANDS = ("evaluate_now", "set_eval_interval", "scale_lr", "stop")


@dataclass(frozen=True, slots=True, kw_only=True)
class CommandEvent(Event):
    type: ClassVar[str] = "command"
    table: ClassVar[str] = "commands"

    command: str = rule(choices=COMMANDS)
    target_node: str | None = rule(None, nonempty=True, max_len=128)
    args: Mapping[str, Any] = rule(factory=dict)
    reason: str = rule("", max_len=4096)

    def _check_rules(self) -> None:
        if self.command == "set_eval_interval":
            steps = self.args.get("steps")
            if not _is_int(steps) or steps < 1:
                raise ValidationError("commands.args.steps", f"must be an integer >= 1 (got {steps!r})")
        if self.command == "scale_lr":
            factor = self.args.get("factor")
            if not _is_number(factor) or not (0 < factor <= 100):
                raise ValidationError("commands.args.factor", f"must be a number in (0, 100] (got {factor!r})")


SEVERITIES = ("info", "warning", "critical")


@dataclass(frozen=True, slots=True, kw_only=True)
class AlertEvent(Event):
    type: ClassVar[str] = "alert"
    table: ClassVar[str] = "alerts"

    alert_id: str = rule(factory=new_event_id, nonempty=True, max_len=256)
    kind: str = rule(nonempty=True, max_len=64)
    severity: str = rule("warning", choices=SEVERITIES)
    message: str = rule(max_len=4096)
    step: int | None = rule(None, ge=0)
    value: float | None = None
    threshold: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class RejectedEvent(Event):
    type: ClassVar[str] = "rejected"
    table: ClassVar[str] = "deadletter"

    reason: str = rule(nonempty=True)
    source_topic: str = rule(max_len=256)
    raw: str


RUN_STATUSES = ("running", "finished", "failed", "killed")
TERMINAL_STATUSES = ("finished", "failed", "killed")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunEvent(Event):
    """A run's lifecycle, from each rank: `running` at start, one terminal status at the end."""

    type: ClassVar[str] = "run"
    table: ClassVar[str] = "runs"

    status: str = rule(choices=RUN_STATUSES)
    config: Mapping[str, Any] = rule(factory=dict)
    tags: tuple[str, ...] = rule(factory=tuple, max_len=256)
    group: str | None = rule(None, max_len=256)
    world_size: int = rule(1, ge=1, le=1 << 20)
    host: str | None = rule(None, max_len=256)
    attempt: int = rule(0, ge=0, le=1 << 20)
    framework: str | None = rule(None, max_len=64)
    git_commit: str | None = rule(None, max_len=64)
    exit_code: int | None = rule(None, ge=-(2**31), le=2**31 - 1)


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (
        StepEvent, EvalEvent, EvalConsensusEvent, RewardSmoothedEvent, CommandEvent, AlertEvent, RejectedEvent, RunEvent,
    )
}


# ---------------------------------------------------------------- reading


def event_from_dict(data: Any, expected: type[Event] | None = None) -> Event:
    """Build a record from a decoded JSON object; raises ValidationError."""
    if not isinstance(data, dict):
        raise ValidationError("event", f"not a JSON object ({type(data).__name__})")
    type_name = data.get("type")
    cls = EVENT_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ValidationError("event.type", f"unknown event type {type_name!r} (expected one of {', '.join(EVENT_TYPES)})")
    if expected is not None and cls is not expected:
        raise ValidationError("event.type", f"{type_name!r} does not belong here (expected {expected.type!r})")
    schema = data.get("schema", None)
    if _is_int(schema) and schema > SCHEMA_VERSION:
        raise ValidationError(f"{cls.table}.schema", f"unsupported major {schema} (this reader knows {SCHEMA_VERSION})")
    kwargs = {}
    for c in _checks(cls):
        if c.name in data:
            kwargs[c.name] = data[c.name]
    for c in _checks(cls):
        if c.name not in data and not c.optional and _has_no_default(cls, c.name):
            raise ValidationError(f"{cls.table}.{c.name}", "missing")
    # Readers never invent an envelope: these must come from the writer.
    for name in ("event_id", "ts", "run_id"):
        if name not in data:
            raise ValidationError(f"{cls.table}.{name}", "missing")
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field without default
        raise ValidationError(cls.table, str(exc)) from None


def _has_no_default(cls: type, name: str) -> bool:
    f = cls.__dataclass_fields__[name]  # type: ignore[attr-defined]
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


# orjson reads an integer beyond 64 bits as a float; `json` keeps it an int, which the
# field checks refuse by name. Such a digit run (or a long mantissa) goes to `json`.
_LONG_NUMBER = re.compile(rb"\d{19,}")


def _loads(raw: bytes | str) -> Any:
    """json.loads, through orjson where the two agree: for anything orjson refuses (NaN,
    a BOM, a lone surrogate, bad UTF-8...) `json` decides, with its own error."""
    if orjson is not None and isinstance(raw, bytes) and not _LONG_NUMBER.search(raw):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)


def dumps_compact(data: dict[str, Any]) -> bytes:
    """json.dumps(data, allow_nan=False, compact), through orjson where the two agree.

    For the client's step records, on the sender thread (the GIL time a step takes
    from training). orjson writes NaN as null and refuses an integer beyond 64 bits
    or a key that is not a string: any of these, or a null anywhere, and `json`
    decides, with its own result or error.
    """
    if orjson is not None:
        try:
            out = orjson.dumps(data)
        except TypeError:
            out = b"null"
        if b"null" not in out:
            return out
    return json.dumps(data, allow_nan=False, separators=(",", ":")).encode()


def parse_event(raw: bytes | str, expected: type[Event] | None = None) -> Event:
    """Bytes off the wire -> record. Raises ValidationError naming the field."""
    if len(raw) > MAX_MESSAGE_BYTES:
        raise ValidationError("event", f"message too large ({len(raw)} bytes > {MAX_MESSAGE_BYTES})")
    try:
        data = _loads(raw)
    except UnicodeDecodeError as exc:
        raise ValidationError("event", f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ValidationError("event", "JSON nested too deeply") from None
    except ValueError as exc:
        raise ValidationError("event", f"not valid JSON ({exc})") from None
    return event_from_dict(data, expected)
