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
import socket
import time
import types
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from producers.field_rules import (
    ValidationError,
    check_value,
    field_checks,
    field_values,
    is_int,
    is_number,
    record_accept,
    rule,
)
from producers.ids import RUN_ID_PATTERN

try:  # compiled JSON for readers (worker, sink); the bare client package does without
    import orjson
except ImportError:
    orjson = None  # type: ignore[assignment]

SCHEMA_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20  # a reader refuses larger messages before parsing them
_HOSTNAME = socket.gethostname()[:128] or "localhost"


def new_event_id() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------- records


def _frozen(kind: str, v: Any) -> Any:
    """The immutable form a record keeps of a list or dict field given as one (None: as it is)."""
    if kind in ("int_list", "str_list", "sample_list") and isinstance(v, list):
        return tuple(v)
    if kind in ("float_map", "json_map") and isinstance(v, dict):
        return types.MappingProxyType(dict(v))
    return None


_CONTAINER_KINDS = ("int_list", "str_list", "sample_list", "float_map", "json_map")
_CONTAINERS: dict[type, tuple[Any, ...]] = {}


def _container_checks(cls: type) -> tuple[Any, ...]:
    """The checks of `cls`'s list and map fields (the ones `_frozen` converts)."""
    found = _CONTAINERS.get(cls)
    if found is None:
        found = _CONTAINERS[cls] = tuple(c for c in field_checks(cls) if c.kind in _CONTAINER_KINDS)
    return found


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
        # Lists and dicts as given (e.g. parsed JSON) become their immutable forms; then one
        # call checks every field, and only a record it refuses takes the field-by-field
        # check, which words the error.
        self._freeze()
        if not record_accept(type(self))(*field_values(self)):
            self._check_fields()
        self._check_rules()

    def _freeze(self) -> None:
        """Lists and dicts of list and map fields in their immutable forms."""
        for c in _container_checks(type(self)):
            frozen = _frozen(c.kind, getattr(self, c.name))
            if frozen is not None:
                object.__setattr__(self, c.name, frozen)

    def _check_fields(self) -> None:
        for c, v in zip(field_checks(type(self)), field_values(self)):
            if (v is None and c.optional) or c.passes(v):
                continue
            if v is None:
                raise ValidationError(f"{self.table}.{c.name}", "missing")
            frozen = _frozen(c.kind, v)
            if frozen is not None:  # a list or dict as given: kept as its immutable form
                v = frozen
                object.__setattr__(self, c.name, v)
                if c.passes(v):
                    continue
            check_value(f"{self.table}.{c.name}", c, v)

    def _check_rules(self) -> None:
        """Rules across fields; subclasses add theirs."""

    def to_dict(self) -> dict[str, Any]:
        """{"type": ..., then every field that is not None, in field order}: lists and maps
        as plain lists and dicts (generated per class by `_slot_builders`)."""
        raise NotImplementedError

    def to_json(self) -> bytes:
        return dumps_compact(self.to_dict())

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
            if not is_int(steps) or steps < 1:
                raise ValidationError("commands.args.steps", f"must be an integer >= 1 (got {steps!r})")
        if self.command == "scale_lr":
            factor = self.args.get("factor")
            if not is_number(factor) or not (0 < factor <= 100):
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


_DEFAULT_FROM_FACTORY = object()  # an argument left out whose default comes from a factory


def _slot_builders(cls: type[Event]) -> tuple[Any, Any, Any]:
    """The record's `__init__`, its reader of a decoded JSON object and its `to_dict`, as
    code generated once per class. The first two write each field through its slot's
    descriptor: a frozen dataclass's own `__init__` goes through `object.__setattr__` by
    name for every field, a third of building a 28-field StepEvent. Then `__post_init__`,
    as the dataclass's does. `to_dict` names each field rather than looping over the
    fields' kinds (a reward_smoothed's JSON is written once per step).

    `__init__` has the dataclass's signature and defaults. The reader takes each field from
    the object by name (one that is absent gets its default; other keys are ignored), as
    `cls(**{known keys})` would, without filtering the object into keyword arguments and
    matching them to 20-30 parameters by name (a fifth of the stream worker's CPU at one
    rank). Its caller checks first that the fields without a default are there."""
    namespace: dict[str, Any] = {"_FROM_FACTORY": _DEFAULT_FROM_FACTORY, "_new": object.__new__, "_cls": cls}
    params, init_body, read_body = [], [], []
    plain = {c.name: _PLAIN_FORM.get(c.kind, "v") for c in field_checks(cls)}
    dict_body = [f"    out = {{'type': {cls.type!r}}}"]
    for f in dataclasses.fields(cls):
        if not (f.init and f.kw_only):
            raise TypeError(f"{cls.__name__}.{f.name}: a record's fields are keyword-only init fields")
        if f.name in ("self", "data", "get", "out", "v"):  # the generated functions' own names
            raise TypeError(f"{cls.__name__}.{f.name}: a field may not be named {f.name!r}")
        slot = next(c.__dict__[f.name] for c in cls.__mro__ if f.name in c.__dict__)
        namespace[f"_set_{f.name}"] = slot.__set__
        value, read = f.name, f"data[{f.name!r}]"
        if f.default is not dataclasses.MISSING:
            namespace[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
            read = f"get({f.name!r}, _default_{f.name})"
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f"_factory_{f.name}"] = f.default_factory
            params.append(f"{f.name}=_FROM_FACTORY")
            value = f"_factory_{f.name}() if {f.name} is _FROM_FACTORY else {f.name}"
            read = f"get({f.name!r}, _FROM_FACTORY)"
            read_body.append(f"    {f.name} = {read}")
            read = value
        else:
            params.append(f.name)
        init_body.append(f"    _set_{f.name}(self, {value})")
        read_body.append(f"    _set_{f.name}(self, {read})")
        dict_body.append(f"    v = self.{f.name}\n    if v is not None:\n        out[{f.name!r}] = {plain[f.name]}")
    source = (f"def __init__(self, *, {', '.join(params)}):\n" + "\n".join(init_body)
              + "\n    self.__post_init__()\n"
              + "def read(data):\n    self = _new(_cls)\n    get = data.get\n" + "\n".join(read_body)
              + "\n    self.__post_init__()\n    return self\n"
              + "def to_dict(self):\n" + "\n".join(dict_body) + "\n    return out\n")
    exec(source, namespace)  # noqa: S102 - our own text, as dataclasses builds its __init__
    init, read, to_dict = namespace["__init__"], namespace["read"], namespace["to_dict"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"  # errors read as the dataclass's did
    read.__qualname__ = f"{cls.__qualname__}._read"
    to_dict.__qualname__ = f"{cls.__qualname__}.to_dict"
    to_dict.__doc__ = Event.to_dict.__doc__
    return init, read, to_dict


# What `to_dict` writes for a field of a kind (v: the field's value, not None); others as they are.
_PLAIN_FORM = {"int_list": "list(v)", "str_list": "list(v)", "sample_list": "[dict(x) for x in v]",
               "float_map": "dict(v)", "json_map": "dict(v)"}
_READERS: dict[type, Any] = {}  # record class -> its reader of a decoded JSON object
for _cls in EVENT_TYPES.values():
    _cls.__init__, _READERS[_cls], _cls.to_dict = _slot_builders(_cls)  # type: ignore[method-assign]


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
    if is_int(schema) and schema > SCHEMA_VERSION:
        raise ValidationError(f"{cls.table}.schema", f"unsupported major {schema} (this reader knows {SCHEMA_VERSION})")
    for name in _required(cls):
        if name not in data:
            raise ValidationError(f"{cls.table}.{name}", "missing")
    # Readers never invent an envelope: these must come from the writer.
    for name in ("event_id", "ts", "run_id"):
        if name not in data:
            raise ValidationError(f"{cls.table}.{name}", "missing")
    return _READERS[cls](data)


_REQUIRED: dict[type, tuple[str, ...]] = {}


def _required(cls: type[Event]) -> tuple[str, ...]:
    """The fields of `cls` a writer must send: not optional and without a default."""
    found = _REQUIRED.get(cls)
    if found is None:
        fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
        found = _REQUIRED[cls] = tuple(
            c.name for c in field_checks(cls) if not c.optional and fields[c.name].default is dataclasses.MISSING
            and fields[c.name].default_factory is dataclasses.MISSING)
    return found


# orjson reads an integer beyond 64 bits as a float; `json` keeps it an int, which the
# field checks refuse by name. Such a digit run (or a long mantissa) goes to `json`.
# Every digit becomes "0" (nothing else does), so a run of 19 digits is a run of 19 zeros,
# found by a substring search: 0.7 us for a step event here, where the regex \d{19,} took 4.
_DIGITS_AS_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19


def has_long_number(raw: bytes) -> bool:
    """Does `raw` hold 19 or more consecutive ASCII digits (anywhere, strings included)?"""
    return _LONG_RUN in raw.translate(_DIGITS_AS_ZERO)


def _loads(raw: bytes | str) -> Any:
    """json.loads, through orjson where the two agree: for anything orjson refuses (NaN,
    a BOM, a lone surrogate, bad UTF-8...) `json` decides, with its own error."""
    if orjson is not None and isinstance(raw, bytes) and not has_long_number(raw):
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
