"""The event contract: immutable typed records, one class per event type.

Each record is a frozen msgspec Struct whose field types carry their rules (types, ranges,
lengths, choices), so the contract in docs/CONTRACT.md reads straight off this file.
msgspec makes every record, one way or the other: it decodes a reader's bytes (`parse_event`)
or converts fields (`event_from_dict`, `build`, `replace`, and `StepEvent(...)` itself: the
records' metaclass makes calling a class its `build`). Either way it checks the types in C,
then calls `__post_init__`, which checks what types cannot say (storage-safe text, the rules
across fields), so an invalid event cannot exist in memory. The error names the field and the
rule, e.g. ``steps.reward: not finite``. (`msgspec.structs.replace` and `force_setattr` skip
the types: the library changes a record with its `replace`.)
"""

from __future__ import annotations

import json
import operator
import socket
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar, get_args, overload

import msgspec

from areal_metrics.producers.contract.field_rules import (
    MESSAGE_MAX,
    NON_FINITE_MAX,
    NUMBER_MAX,
    TS_MAX,
    UINT32_MAX,
    DerivedMetrics,
    Float,
    Int,
    JsonObject,
    Measured,
    Metrics,
    Samples,
    Text,
    ValidationError,
    check_json,
    check_samples,
    check_texts,
    from_msgspec,
    text_fields,
    is_int,
    is_number,
)
from areal_metrics.producers.contract.ids import RUN_ID_PATTERN
from areal_metrics.producers.contract.limits import StructureLimits, check_structure, default_limits

SCHEMA_VERSION = 1
_HOSTNAME = socket.gethostname()[:128] or "localhost"


def new_event_id() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------- field types

RunId = Text(128, nonempty=True, pattern=f"^(?:{RUN_ID_PATTERN.pattern})$")
Name = Text(128, nonempty=True)  # a node, a dataset, an event id
Count = Int(ge=0)
Count32 = Int(ge=0, le=UINT32_MAX)  # a count a UInt32 column holds
Step = Int(ge=0)
Attempt = Int(ge=0, le=1 << 20)
WorldSize = Int(ge=1, le=1 << 20)
Replicas = Int(ge=1, le=4096)
Number = Measured  # a number a trainer sends: finite, |x| <= NUMBER_MAX (field_rules)
NonNegative = Float(ge=0, le=NUMBER_MAX)
Finite = Float()  # what the worker derives (a slope, an alert's value): any finite number
Timestamp = Float(ge=0, le=TS_MAX)
Fraction = Float(ge=0, le=1)
Message = Text(MESSAGE_MAX)
Stage = Literal["quick", "full"]
EvalStatus = Literal["ok", "failed", "skipped"]
RunStatus = Literal["running", "finished", "failed", "killed"]
Command = Literal["evaluate_now", "set_eval_interval", "scale_lr", "stop"]
Severity = Literal["info", "warning", "critical"]
# what the stream worker raises (and, for poison_message, a service that a message crashed twice)
AlertKind = Literal["reward_below_threshold", "eval_failed", "node_divergence", "throughput_drop", "stalled",
                    "invalid_event", "non_finite", "no_improvement", "eval_below_threshold", "vote_no_majority",
                    "run_failed", "run_killed", "invalid_config",
                    "command_not_applied", "command_ignored", "poison_message", "vote_undecided"]
AckStatus = Literal["applied", "ignored"]

EVAL_STATUSES: tuple[str, ...] = get_args(EvalStatus)
RUN_STATUSES: tuple[str, ...] = get_args(RunStatus)
TERMINAL_STATUSES = ("finished", "failed", "killed")
COMMANDS: tuple[str, ...] = get_args(Command)
SEVERITIES: tuple[str, ...] = get_args(Severity)
ALERT_KINDS: tuple[str, ...] = get_args(AlertKind)
ACK_STATUSES: tuple[str, ...] = get_args(AckStatus)


# --------------------------------------------------------------------- records

_R = TypeVar("_R")


class _RecordClass(msgspec.StructMeta):
    """The records' metaclass: calling a record class is its `build`, so that msgspec makes every
    record (decoding bytes, converting fields) and has checked its fields before `__post_init__`."""

    def __call__(cls: type[_R], *args: Any, **fields: Any) -> _R:
        if args:
            raise TypeError(f"{cls.__name__}() takes keyword arguments only")
        return cls.build(**fields)  # type: ignore[attr-defined]


class Event(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type", metaclass=_RecordClass):
    """The envelope every event carries (see CONTRACT.md, 'Envelope').

    A record class names its type on the wire once, as msgspec's `tag`: msgspec writes it first
    (`{"type":"step",...}`) and checks it where present on reading; `cls.type` is that tag."""

    type: ClassVar[str] = ""  # the class's msgspec tag (set below, with EVENT_TYPES)
    table: ClassVar[str] = ""  # ClickHouse table, also the prefix of error messages

    run_id: RunId
    node: Name = _HOSTNAME
    rank: Count32 = 0
    ts: Timestamp = msgspec.field(default_factory=time.time)
    event_id: Name = msgspec.field(default_factory=new_event_id)
    schema: Int(ge=1, le=SCHEMA_VERSION) = SCHEMA_VERSION

    def __post_init__(self) -> None:
        """Run by msgspec on every record it makes, once it has checked the types and bounds."""
        cls = type(self)
        check_texts(cls.table, _TEXT_FIELDS[cls], _TEXT_GETTERS[cls](self))
        self._check_rules()

    @classmethod
    def build(cls, **fields: Any) -> Self:
        """The record of these fields, which `cls(**fields)` calls: msgspec converts them (numbers
        come out as their field's type: an int given for a float field is a float). An unknown or
        missing name is a TypeError, as a Python call says it; a bad value a ValidationError."""
        if not _FIELD_NAMES[cls].issuperset(fields):
            unknown = sorted(set(fields) - _FIELD_NAMES[cls])
            raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
        if not fields.keys() >= _REQUIRED[cls]:
            missing = next(name for name in cls.__struct_fields__ if name in _REQUIRED[cls] and name not in fields)
            raise TypeError(f"Missing required argument {missing!r}")
        return _convert(fields, cls)  # type: ignore[return-value]

    def _check_rules(self) -> None:
        """What the field types cannot say beyond storage-safe text (checked for every class):
        nested JSON, sample rows and rules across fields, in the classes that have them."""

    def to_dict(self) -> dict[str, Any]:
        """{"type": ..., then every field that is not None, in field order}, lists as lists."""
        out: dict[str, Any] = {"type": self.type}
        for name, v in zip(self.__struct_fields__, msgspec.structs.astuple(self)):
            if v is not None:
                out[name] = list(v) if type(v) is tuple else v
        return out

    def to_json(self) -> bytes:
        """The JSON of `to_dict()`. A record with no None field is all its fields in order:
        msgspec writes the record itself, its tag first."""
        if None in msgspec.structs.astuple(self):
            return _encode(self.to_dict())
        return _encode(self)

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed, built as a new record is; the event_id is kept unless given."""
        return self.build(**{**msgspec.structs.asdict(self), **changes})

    __replace__ = replace  # copy.replace (Python 3.13): msgspec's own would not check the types


class StepEvent(Event, frozen=True, kw_only=True, gc=False, tag="step"):
    table: ClassVar[str] = "steps"

    step: Step
    epoch: NonNegative  # completed epochs; fractional as HF's `state.epoch`
    reward: Number | None = None
    reward_std: NonNegative | None = None
    entropy: Number | None = None
    advantage_mean: Number | None = None
    advantage_std: NonNegative | None = None
    kl: Number | None = None
    clip_ratio: Fraction | None = None
    loss: Number | None = None
    lr: NonNegative | None = None
    grad_norm: NonNegative | None = None
    response_length: NonNegative | None = None
    tokens: Count | None = None
    throughput: NonNegative | None = None
    latency_ms: NonNegative | None = None
    gpu_mem_bytes: Count | None = None
    metrics: Metrics = {}
    world_size: WorldSize | None = None  # ranks that publish this step
    attempt: Attempt = 0  # a resumed run publishes with attempt + 1
    non_finite: Annotated[tuple[Text(256), ...], msgspec.Meta(max_length=NON_FINITE_MAX)] = ()  # fields/metrics whose NaN/inf is null here
    # samples behind this rank's reward: its weight over ranks. A UInt32 each, so a step's sum over its
    # ranks (at most WorldSize) stays far inside the UInt64 the store sums them in (v_step_means)
    n_samples: Count32 | None = None

    def _check_rules(self) -> None:
        if self.world_size is not None and self.rank >= self.world_size:
            raise ValidationError("steps.rank", f"{self.rank} is not below world_size {self.world_size}")


# The typed step columns: a step's optional numbers that `run.log` fills by name, each a column of
# `steps` (any other name goes into `metrics`). The one list: the client's names and bounds
# (producers/client/aliases.py) and the rank means of `v_step_means` (sinks/step_means.py) derive
# from it; tests/test_typed_columns.py holds the schema, the migrations and the docs to it
# (ARCHITECTURE.md, "Add a typed step column").
_STEP_UNTYPED = frozenset({"step", "epoch", "metrics", "world_size", "attempt", "non_finite"})
TYPED_STEP_COLUMNS: tuple[str, ...] = tuple(
    f for f in StepEvent.__struct_fields__ if f not in Event.__struct_fields__ and f not in _STEP_UNTYPED
)


class EvalEvent(Event, frozen=True, kw_only=True, gc=False, tag="eval"):
    table: ClassVar[str] = "evals"

    eval_id: Text(256, nonempty=True)
    step: Step
    dataset: Name
    stage: Stage = "full"
    status: EvalStatus = "ok"
    accuracy: Fraction | None = None
    response_length: NonNegative | None = None
    reward: Number | None = None
    n_samples: Count32 | None = None
    latency_ms: NonNegative | None = None
    verdicts: tuple[Int(ge=0, le=1), ...] | None = None
    error: Message | None = None
    replicas: Replicas = 1
    dataset_fingerprint: Name | None = None
    metrics: Metrics = {}  # e.g. pass@4, maj@4
    samples: Samples | None = None  # {prompt, response, verdict, reward, gold, error_type}: the generations table
    attempt: Attempt = 0
    # Evaluation you can trust: each verdict's sample in the dataset's shared order (None: 0..len-1),
    # and how many nodes share a sharded round (None: replicas). No layout lives in `metrics`.
    sample_ids: tuple[Int(ge=0, le=(1 << 32) - 1), ...] | None = None
    shard_nodes: Replicas | None = None

    def _check_rules(self) -> None:
        if self.samples:
            check_samples(f"{self.table}.samples", self.samples)
        if self.status == "ok" and self.accuracy is None:
            raise ValidationError("evals.accuracy", "missing (required when status is ok)")
        if self.verdicts is not None and self.n_samples is not None and len(self.verdicts) != self.n_samples:
            raise ValidationError(
                "evals.verdicts", f"has {len(self.verdicts)} entries but n_samples is {self.n_samples}"
            )
        if self.sample_ids is not None:
            if self.verdicts is None or len(self.sample_ids) != len(self.verdicts):
                n = "no verdicts" if self.verdicts is None else f"{len(self.verdicts)} verdicts"
                raise ValidationError("evals.sample_ids", f"has {len(self.sample_ids)} entries but there are {n}")
            if len(set(self.sample_ids)) != len(self.sample_ids):
                raise ValidationError("evals.sample_ids", "names a sample more than once")
        if self.shard_nodes is not None and self.shard_nodes < self.replicas:
            raise ValidationError("evals.shard_nodes",
                                  f"{self.shard_nodes} is fewer than replicas ({self.replicas}): "
                                  "a sample cannot have more replicas than the nodes sharing the round")


class EvalConsensusEvent(Event, frozen=True, kw_only=True, gc=False, tag="eval_consensus"):
    table: ClassVar[str] = "eval_consensus"

    eval_id: Text(256, nonempty=True)
    step: Step
    dataset: Name
    stage: Stage = "full"
    accuracy: Fraction
    response_length: Float(ge=0) | None = None
    votes: Count32
    replicas: Int(ge=1, le=UINT32_MAX)
    agreement: Fraction
    dissenters: tuple[Text(256), ...] = ()
    stale: bool = False
    partial: bool = False
    # Evaluation you can trust: decided samples behind `accuracy`, undecided ones (ties), and a
    # 95 % interval of `accuracy` (None on events written before these fields existed).
    n_samples: Count32 | None = None
    n_undecided: Count32 | None = None
    ci_low: Fraction | None = None
    ci_high: Fraction | None = None
    # Evaluation details: pass@K, maj@K, greedy_accuracy over the round (streams.core.voting)
    metrics: DerivedMetrics = {}

    def _check_rules(self) -> None:
        if self.ci_low is not None and self.ci_high is not None and self.ci_low > self.ci_high:
            raise ValidationError("eval_consensus.ci_low", f"{self.ci_low} is above ci_high {self.ci_high}")


class RewardSmoothedEvent(Event, frozen=True, kw_only=True, gc=False, tag="reward_smoothed"):
    table: ClassVar[str] = "rewards_smoothed"

    step: Step
    reward: Number
    window: Int(ge=1, le=UINT32_MAX)
    sliding_avg: Finite
    ema: Finite
    slope: Finite


class CommandEvent(Event, frozen=True, kw_only=True, gc=False, tag="command"):
    table: ClassVar[str] = "commands"

    command: Command
    target_node: Name | None = None
    args: JsonObject = {}
    reason: Message = ""

    def _check_rules(self) -> None:
        check_json(f"{self.table}.args", self.args)
        if self.command == "set_eval_interval":
            steps = self.args.get("steps")
            if not is_int(steps) or steps < 1:
                raise ValidationError("commands.args.steps", f"must be an integer >= 1 (got {steps!r})")
        if self.command == "scale_lr":
            factor = self.args.get("factor")
            if not is_number(factor) or not (0 < factor <= 100):
                raise ValidationError("commands.args.factor", f"must be a number in (0, 100] (got {factor!r})")
            restore = self.args.get("restore_step", 0)
            if not is_int(restore) or restore < 0:
                raise ValidationError("commands.args.restore_step", f"must be an integer >= 0 (got {restore!r})")


class CommandAckEvent(Event, frozen=True, kw_only=True, gc=False, tag="command_ack"):
    """A trainer node's answer to one command: applied (at which step, the lr factor since) or ignored (why).

    Trainers write it on their own topic (`areal.acks`), never on the control topic."""

    table: ClassVar[str] = "command_acks"

    command_id: Name  # the command's event_id
    command: Command
    status: AckStatus
    step: Step | None = None  # the step from which it applies (the first update it changed)
    lr_factor: NonNegative | None = None  # the node's cumulative lr factor after it
    detail: Message = ""  # why it was ignored, or what was applied with limits
    attempt: Attempt = 0


class AlertEvent(Event, frozen=True, kw_only=True, gc=False, tag="alert"):
    table: ClassVar[str] = "alerts"

    alert_id: Text(256, nonempty=True) = msgspec.field(default_factory=new_event_id)
    kind: Text(64, nonempty=True)  # one of ALERT_KINDS from our worker; other writers may name their own
    severity: Severity = "warning"
    message: Message
    step: Step | None = None
    value: Finite | None = None
    threshold: Finite | None = None


class RejectedEvent(Event, frozen=True, kw_only=True, gc=False, tag="rejected"):
    table: ClassVar[str] = "deadletter"

    reason: Text(nonempty=True)
    source_topic: Text(256)
    raw: str


class RunEvent(Event, frozen=True, kw_only=True, gc=False, tag="run"):
    """A run's lifecycle, from each rank: `running` at start, one terminal status at the end."""

    table: ClassVar[str] = "runs"

    status: RunStatus
    config: JsonObject = {}
    tags: Annotated[tuple[Text(256), ...], msgspec.Meta(max_length=256)] = ()
    group: Text(256) | None = None
    world_size: WorldSize = 1
    host: Text(256) | None = None
    attempt: Attempt = 0
    framework: Text(64) | None = None
    git_commit: Text(64) | None = None
    exit_code: Int(ge=-(2**31), le=2**31 - 1) | None = None
    name: Text(256) | None = None  # init(name=...): a free-form display name beside the run_id
    notes: Message | None = None  # init(notes=...): free text about the run, as W&B's notes
    summary: JsonObject | None = None  # run.summary: on the rank's terminal event, when it holds anything

    def _check_rules(self) -> None:
        if self.rank >= self.world_size:
            raise ValidationError("runs.rank", f"{self.rank} is not below world_size {self.world_size}")
        check_json(f"{self.table}.config", self.config)
        if self.summary is not None:
            check_json(f"{self.table}.summary", self.summary)


_RECORDS: tuple[type[Event], ...] = (
    StepEvent, EvalEvent, EvalConsensusEvent, RewardSmoothedEvent, CommandEvent, AlertEvent, RejectedEvent, RunEvent,
    CommandAckEvent,
)
for _cls in _RECORDS:
    _cls.type = str(_cls.__struct_config__.tag)
EVENT_TYPES: dict[str, type[Event]] = {cls.type: cls for cls in _RECORDS}
_DECODERS = {cls: msgspec.json.Decoder(cls) for cls in EVENT_TYPES.values()}
_FIELD_NAMES = {cls: frozenset(cls.__struct_fields__) for cls in EVENT_TYPES.values()}
_REQUIRED = {cls: frozenset(f.name for f in msgspec.structs.fields(cls) if f.required) for cls in EVENT_TYPES.values()}
_encode = msgspec.json.Encoder().encode
_TEXT_FIELDS = {cls: text_fields(cls) for cls in EVENT_TYPES.values()}
_TEXT_GETTERS = {cls: operator.attrgetter(*names) for cls, names in _TEXT_FIELDS.items()}


# ---------------------------------------------------------------- reading


class _Head(msgspec.Struct, gc=False):
    """What a reader looks at before the record: its type, schema and envelope (present or not)."""

    type: Any = None
    schema: Any = None
    event_id: msgspec.Raw = msgspec.Raw()
    ts: msgspec.Raw = msgspec.Raw()
    run_id: msgspec.Raw = msgspec.Raw()


_read_head = msgspec.json.Decoder(_Head).decode


def _record_class(type_name: Any, schema: Any, present: tuple[bool, bool, bool],
                  expected: type[Event] | None) -> type[Event]:
    cls = EVENT_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ValidationError("event.type", f"unknown event type {type_name!r} (expected one of {', '.join(EVENT_TYPES)})")
    if expected is not None and cls is not expected:
        raise ValidationError("event.type", f"{type_name!r} does not belong here (expected {expected.type!r})")
    if is_int(schema) and schema > SCHEMA_VERSION:
        raise ValidationError(f"{cls.table}.schema", f"unsupported major {schema} (this reader knows {SCHEMA_VERSION})")
    if False in present:  # Readers never invent an envelope: these must come from the writer.
        raise ValidationError(f"{cls.table}.{('event_id', 'ts', 'run_id')[present.index(False)]}", "missing")
    return cls


_E = TypeVar("_E", bound=Event)


@overload
def event_from_dict(data: Any, expected: type[_E]) -> _E: ...
@overload
def event_from_dict(data: Any, expected: None = None) -> Event: ...
def event_from_dict(data: Any, expected: type[Event] | None = None) -> Event:
    """Build a record from a decoded JSON object (of class `expected`, when given); raises ValidationError."""
    if not isinstance(data, dict):
        raise ValidationError("event", f"not a JSON object ({type(data).__name__})")
    cls = _record_class(data.get("type"), data.get("schema"),
                        ("event_id" in data, "ts" in data, "run_id" in data), expected)
    return _convert(data, cls)


def _convert(data: dict[str, Any], cls: type[Event]) -> Event:
    """msgspec.convert(data, cls), its errors in ours. A lone surrogate in a string msgspec has to
    read as something else (a number, a choice) makes it raise UnicodeEncodeError, not a
    ValidationError: the nested-JSON walk then names the string."""
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise from_msgspec(cls, exc) from None
    except UnicodeEncodeError:
        check_json(cls.table, data)  # raises, naming the first string UTF-8 cannot hold
        raise ValidationError(cls.table, "holds text UTF-8 cannot encode") from None


def parse_event(raw: bytes | str, expected: type[Event] | None = None,
                limits: StructureLimits | None = None) -> Event:
    """Bytes off the wire -> record: the one guard every reader decodes a message in (the stream
    worker, the sink, replay, the client's control feed, `alerts --follow`, `watch`).

    It raises ValidationError naming the field, and nothing else: the structure limits first
    (`check_structure`, on the bytes, before any parser builds the message), then the record's
    rules; any other exception while reading this one message (a bug, a recursion, memory) is
    the message's problem too, in a ValidationError that names it, so a reader dead-letters
    the message and goes on. `limits`: those the process's entry point installed (AREAL_MAX_*) when None."""
    where = expected.table if expected is not None else "event"
    lim = limits or default_limits()  # outside the guard: a bad setting is not a bad message
    try:
        check_structure(raw, where, lim)
        return _parse(raw, expected)
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - one message must never stop its reader
        detail = " ".join(str(exc).split())[:200]
        raise ValidationError(where, f"could not be read ({type(exc).__name__}{': ' + detail if detail else ''})") from None


def _parse(raw: bytes | str, expected: type[Event] | None) -> Event:
    """`parse_event` past the structure limits."""
    if isinstance(raw, bytes) and not raw.isascii():
        try:  # msgspec skips the fields it does not read without looking at their bytes
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValidationError("event", f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        head = _read_head(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):  # not an object; or NaN, a lone surrogate...
        return event_from_dict(_loads(raw), expected)
    cls = _record_class(head.type, head.schema, (bool(head.event_id), bool(head.ts), bool(head.run_id)), expected)
    try:
        return _DECODERS[cls].decode(raw)
    except msgspec.ValidationError as exc:
        raise from_msgspec(cls, exc) from None
    except msgspec.DecodeError:  # what msgspec refuses and `json` may take (NaN, a lone surrogate escape)
        pass
    return event_from_dict(_loads(raw), expected)


def _loads(raw: bytes | str) -> Any:
    """json.loads, whose errors name what is wrong with the bytes."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise ValidationError("event", f"not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise ValidationError("event", "JSON nested too deeply") from None
    except ValueError as exc:
        raise ValidationError("event", f"not valid JSON ({exc})") from None


def dumps_compact(data: dict[str, Any]) -> bytes:
    """json.dumps(data, allow_nan=False, compact), through msgspec where the two agree.

    For the client's step records, on the sender thread (the GIL time a step takes
    from training). msgspec writes NaN as null and refuses a key that is not a string:
    either, or a null anywhere, and `json` decides, with its own result or error.
    """
    try:
        out = msgspec.json.encode(data)
    except (TypeError, OverflowError, msgspec.EncodeError):
        out = b"null"
    if b"null" not in out:
        return out
    return json.dumps(data, allow_nan=False, separators=(",", ":")).encode()
