"""The event contract: records, JSON round trip, and errors that name the field."""

import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import (
    EVENT_TYPES,
    AlertEvent,
    CommandAckEvent,
    CommandEvent,
    EvalConsensusEvent,
    EvalEvent,
    RejectedEvent,
    RewardSmoothedEvent,
    RunEvent,
    StepEvent,
    ValidationError,
    event_from_dict,
    parse_event,
)
from areal_metrics.producers.contract.field_rules import NUMBER_MAX
from areal_metrics.producers.contract.topics import Topics


def one_of_each():
    common = dict(run_id="run-1", node="node-a", rank=1, ts=1700000000.5)
    return [
        StepEvent(**common, step=3, epoch=0, reward=0.25, reward_std=0.1, entropy=1.2, kl=0.01, clip_ratio=0.2,
                  loss=0.5, lr=1e-3, grad_norm=0.7, response_length=4.0, tokens=128, throughput=900.0,
                  latency_ms=12.5, gpu_mem_bytes=1024, metrics={"value_loss": 0.3}),
        EvalEvent(**common, eval_id="run-1:3:full", step=3, dataset="arith-1digit", stage="full", accuracy=0.75,
                  response_length=2.0, reward=0.75, n_samples=4, latency_ms=30.0, verdicts=(1, 0, 1, 1), replicas=3),
        EvalEvent(**common, eval_id="run-1:4:full", step=4, dataset="arith-2digit", status="failed", error="OOM"),
        EvalConsensusEvent(**common, eval_id="run-1:3:full", step=3, dataset="arith-1digit", accuracy=0.75, votes=3,
                           replicas=3, agreement=1.0, dissenters=("node-c",), stale=False, partial=True),
        RewardSmoothedEvent(**common, step=3, reward=0.25, window=20, sliding_avg=0.2, ema=0.21, slope=0.01),
        CommandEvent(**common, command="set_eval_interval", args={"steps": 20}, reason="reward moves fast"),
        CommandEvent(**common, command="scale_lr", target_node="node-b", args={"factor": 0.5}, reason="low reward"),
        AlertEvent(**common, kind="reward_below_threshold", severity="critical", message="reward 0.1 < 0.2",
                   step=3, value=0.1, threshold=0.2),
        RejectedEvent(**common, reason="steps.reward: not finite (nan)", source_topic="areal.steps", raw="{...}"),
    ]


@pytest.mark.parametrize("event", one_of_each(), ids=lambda e: e.type)
def test_json_round_trip_is_field_by_field_equal(event):
    back = parse_event(event.to_json())
    assert back == event
    assert back.to_dict() == event.to_dict()
    assert json.loads(event.to_json())["type"] == event.type


def test_every_type_has_a_topic():
    topics = Topics("areal.")
    assert {topics.for_event(cls) for cls in EVENT_TYPES.values()} == set(topics.all())
    assert topics.for_event(StepEvent) == "areal.steps"
    assert topics.event_type("areal.evals.consensus") is EvalConsensusEvent


def test_records_are_frozen():
    event = one_of_each()[0]
    with pytest.raises(AttributeError):
        event.reward = 1.0  # type: ignore[misc]
    assert StepEvent(run_id="r", step=1, epoch=0, non_finite=["kl"]).non_finite == ("kl",)  # a list kept as a tuple


def test_event_id_generated_unique_and_kept_on_resend():
    a = StepEvent(run_id="r", step=1, epoch=0)
    b = StepEvent(run_id="r", step=1, epoch=0)
    assert a.event_id != b.event_id
    assert parse_event(a.to_json()).event_id == a.event_id
    assert a.replace(reward=1.0).event_id == a.event_id


def raw_step(**fields):
    base = {"type": "step", "schema": 1, "event_id": "e1", "run_id": "r1", "node": "n", "rank": 0,
            "ts": 1.0, "step": 1, "epoch": 0}
    base.update(fields)
    return json.dumps(base)


@pytest.mark.parametrize(
    "raw, message",
    [
        (raw_step().replace('"step": 1', '"step": 1, "reward": NaN'), "steps.reward: not finite"),
        (raw_step(reward=1e309), "steps.reward: not finite"),
        (raw_step(step=-1), "steps.step: must be >= 0"),
        (raw_step(step=1.5), "steps.step: not an integer (float)"),
        (raw_step(step=True), "steps.step: not an integer (bool)"),
        (raw_step(node="a\ud800"), "steps.node: holds a lone surrogate U+D800"),
        (raw_step(reward="\ud800"), "steps.reward: holds a lone surrogate U+D800"),  # in a number field
        (raw_step(type="eval", stage="\ud800"), "evals.stage: holds a lone surrogate U+D800"),  # in a choice
        (raw_step(metrics={"a\x00": 1}), "steps.metrics key: holds a NUL character"),
        (raw_step(metrics={"": 1}), "steps.metrics key: must not be empty"),
        (raw_step(non_finite=["x", 3]), "steps.non_finite[1]: not a string (int)"),
        (raw_step(type="bogus"), "event.type: unknown event type 'bogus'"),
        (raw_step(schema=99), "steps.schema: unsupported major 99 (this reader knows 1)"),
        (raw_step(run_id="x" * 200), "steps.run_id: longer than 128 chars"),
        (raw_step(run_id="a b"), "steps.run_id: does not match [A-Za-z0-9._:-]{1,128}"),
        (raw_step(clip_ratio=2.0), "steps.clip_ratio: must be <= 1.0"),
        (raw_step(metrics={"a": "x"}), "steps.metrics[...]: not a number (str)"),
        ("not json", "event: not valid JSON"),
        ("[1, 2]", "event: not a JSON object (list)"),
        ('{"type": "step", "run_id": "r"}', "steps.event_id: missing"),
        (raw_step().replace('"step": 1, ', ""), "steps.step: missing"),
        (raw_step(event_id=None), "steps.event_id: not a string (null)"),
        (raw_step(type="eval", stage="soon"), "evals.stage: 'soon' is not one of full, quick"),
    ],
)
def test_invalid_input_names_the_field_and_rule(raw, message):
    with pytest.raises(ValidationError) as err:
        parse_event(raw)
    assert str(err.value).startswith(message)


def test_eval_rules_across_fields():
    with pytest.raises(ValidationError, match=r"evals.accuracy: missing \(required when status is ok\)"):
        EvalEvent(run_id="r", eval_id="e", step=1, dataset="d")
    with pytest.raises(ValidationError, match=r"evals.verdicts\[1\]: must be <= 1"):
        EvalEvent(run_id="r", eval_id="e", step=1, dataset="d", accuracy=0.5, verdicts=(1, 2))
    with pytest.raises(ValidationError, match="evals.verdicts: has 2 entries but n_samples is 3"):
        EvalEvent(run_id="r", eval_id="e", step=1, dataset="d", accuracy=0.5, verdicts=(1, 0), n_samples=3)
    with pytest.raises(ValidationError, match="commands.args.steps"):
        CommandEvent(run_id="r", command="set_eval_interval", args={"steps": 0})
    for bad in (-1, 2.5, True, "0"):
        with pytest.raises(ValidationError, match=r"commands.args.restore_step: must be an integer >= 0"):
            CommandEvent(run_id="r", command="scale_lr", args={"factor": 0.1, "restore_step": bad})
    assert CommandEvent(run_id="r", command="scale_lr", args={"factor": 0.1, "restore_step": 0}).args["restore_step"] == 0


def test_expected_type_on_a_topic():
    with pytest.raises(ValidationError, match="event.type: 'step' does not belong here"):
        parse_event(raw_step(), expected=EvalEvent)


def test_non_utf8_and_deep_json_and_huge_messages_are_rejected_cleanly():
    with pytest.raises(ValidationError, match="event: not"):
        parse_event(b"\xff\xfe{")
    with pytest.raises(ValidationError, match="event: "):
        parse_event("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValidationError, match="event: message too large"):
        parse_event(b" " * (2 << 20))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_random_bytes_never_crash_the_parser(raw):
    try:
        event = parse_event(raw)
    except ValidationError as exc:
        assert ": " in str(exc)
    else:
        assert event.type in EVENT_TYPES


@settings(max_examples=200, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True), st.integers(min_value=-5, max_value=10**12))
def test_numbers_at_the_boundaries(reward, step):
    raw = raw_step(step=step).replace('"step": %d' % step, '"step": %d, "reward": %r' % (step, reward))
    raw = raw.replace("nan", "NaN").replace("inf", "Infinity")
    if math.isfinite(reward) and abs(reward) <= NUMBER_MAX and step >= 0:
        assert parse_event(raw).reward == reward
    else:
        with pytest.raises(ValidationError, match=r"steps\.(reward|step): "):
            parse_event(raw)


def test_integers_beyond_64_bits_are_refused_not_crashing():
    with pytest.raises(ValidationError, match=r"steps.epoch: not finite \(beyond the float range\)"):
        parse_event(raw_step(epoch=10**400))
    with pytest.raises(ValidationError, match=r"steps.step: integer out of the 64-bit range"):
        parse_event(raw_step(step=2**63))
    with pytest.raises(ValidationError, match=r"steps.tokens: integer out of the 64-bit range"):
        parse_event(raw_step(tokens=10**30))
    assert parse_event(raw_step(reward=-(2**64))).reward == -float(2**64)  # a float field takes a big integer as a float


# --- fields the client and the workload added (CONTRACT.md 'Added')


def test_step_carries_fractional_epoch_world_size_attempt_and_non_finite_names() -> None:
    e = StepEvent(run_id="r", step=3, epoch=0.25, world_size=2, attempt=1, non_finite=["kl"], n_samples=8)
    back = parse_event(e.to_json())
    assert (back.epoch, back.world_size, back.attempt, back.non_finite, back.n_samples) == (0.25, 2, 1, ("kl",), 8)
    with pytest.raises(ValidationError, match="steps.world_size"):
        StepEvent(run_id="r", step=3, epoch=0, world_size=0)
    with pytest.raises(ValidationError, match="steps.metrics key"):
        StepEvent(run_id="r", step=3, epoch=0, metrics={"x" * 257: 1.0})


def test_eval_samples_are_checked_field_by_field() -> None:
    ok = EvalEvent(run_id="r", eval_id="e", step=1, dataset="d", accuracy=1.0, dataset_fingerprint="f0",
                   metrics={"pass@4": 1.0}, samples=[{"prompt": "1+1", "response": "2", "verdict": 1, "reward": 1.0}])
    assert parse_event(ok.to_json()).samples == ({"prompt": "1+1", "response": "2", "verdict": 1, "reward": 1.0},)
    for bad, where in (
        ([{"prompt": "p", "verdict": 2}], "evals.samples[0].verdict"),
        ([{"prompt": "p", "extra": 1}], "evals.samples[0]"),
        ([{"prompt": "x" * 5000}], "evals.samples[0].prompt"),
        ([{"reward": float("nan")}], "evals.samples[0].reward"),
        (["text"], "evals.samples[0]"),
        ([{}] * 65, "evals.samples"),
    ):
        with pytest.raises(ValidationError, match=re.escape(where)):
            EvalEvent(run_id="r", eval_id="e", step=1, dataset="d", accuracy=1.0, samples=bad)
    skipped = EvalEvent(run_id="r", eval_id="e", step=1, dataset="d", status="skipped", error="evaluator busy")
    assert skipped.accuracy is None


def test_run_event_config_is_nested_json_with_finite_numbers() -> None:
    run = RunEvent(run_id="r", status="running", config={"lr": 1e-3, "model": {"layers": [64, 64]}}, tags=["a"],
                   group="g", world_size=2, attempt=1, framework="torch", exit_code=None)
    assert parse_event(run.to_json()) == run
    with pytest.raises(ValidationError, match=re.escape("runs.config.model.layers[1]")):
        RunEvent(run_id="r", status="running", config={"model": {"layers": [1, float("inf")]}})
    with pytest.raises(ValidationError, match="runs.status"):
        RunEvent(run_id="r", status="paused")


def test_a_records_init_checks_its_fields_and_fills_its_defaults() -> None:
    import msgspec

    from areal_metrics.producers.contract.events import EVENT_TYPES, SCHEMA_VERSION, StepEvent

    a = StepEvent(run_id="r", step=3, epoch=0.5, reward=0.25)
    b = StepEvent(run_id="r", step=3, epoch=0.5, reward=0.25)
    assert (a.step, a.epoch, a.reward, a.rank, a.schema, a.world_size) == (3, 0.5, 0.25, 0, SCHEMA_VERSION, None)
    assert a.event_id != b.event_id and a.ts > 0  # each factory runs per record
    assert dict(a.metrics) == {} and a.non_finite == ()
    assert a.metrics is not b.metrics  # a mutable default is copied per record
    given = StepEvent(run_id="r", step=3, epoch=0, event_id="e1", ts=2.0, metrics={"m": 1.0})
    assert (given.event_id, given.ts, dict(given.metrics)) == ("e1", 2.0, {"m": 1.0})
    with pytest.raises(TypeError, match="Missing required argument 'step'"):
        StepEvent(run_id="r", epoch=0)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="Unexpected keyword argument 'nope'"):
        StepEvent(run_id="r", step=1, epoch=0, nope=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        StepEvent("r", 1, 0)  # type: ignore[misc]  # keyword-only, as declared
    with pytest.raises(ValidationError, match=r"steps\.step: must be >= 0"):
        StepEvent(run_id="r", step=-1, epoch=0)
    with pytest.raises(ValidationError, match=r"steps\.reward: not finite"):
        StepEvent(run_id="r", step=1, epoch=0, reward=float("nan"))
    with pytest.raises(ValidationError, match=r"steps\.reward: holds a lone surrogate"):
        StepEvent(run_id="r", step=1, epoch=0, reward="\ud800")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"steps\.step: must be >= 0"):
        a.replace(step=-1)  # a changed copy is checked as a new record is
    with pytest.raises(AttributeError):
        a.step = 4  # type: ignore[misc]
    assert a.replace(step=4).step == 4 and a.replace(step=4).event_id == a.event_id
    for cls in EVENT_TYPES.values():  # the envelope's defaults are the same for every type
        fields = {f.name: f for f in msgspec.structs.fields(cls)}
        assert fields["rank"].default == 0 and fields["schema"].default == SCHEMA_VERSION, cls.__name__
        assert fields["run_id"].required and not fields["event_id"].required, cls.__name__


@pytest.mark.parametrize("event", one_of_each(), ids=lambda e: e.type)
def test_build_gives_the_record_the_constructor_gives_and_checks_it_alike(event) -> None:
    import msgspec

    fields = msgspec.structs.asdict(event)
    assert type(event).build(**fields) == type(event)(**fields)
    first = next(f.name for f in msgspec.structs.fields(event) if f.name in ("step", "eval_id", "reason", "kind"))
    with pytest.raises(ValidationError) as by_build:
        type(event).build(**{**fields, first: None})
    with pytest.raises(ValidationError) as by_init:
        type(event)(**{**fields, first: None})
    assert str(by_build.value) == str(by_init.value) and f"{event.table}.{first}" in str(by_build.value)


def test_build_gives_numbers_their_fields_type_and_fills_the_defaults() -> None:
    e = RewardSmoothedEvent.build(run_id="r", step=1, reward=1, window=2, sliding_avg=0, ema=0.5, slope=0)
    assert (type(e.reward), type(e.slope), e.reward) == (float, float, 1.0)
    assert e.event_id and e.ts > 0 and e.rank == 0
    with pytest.raises(TypeError, match="Unexpected keyword argument 'slop'"):  # as the constructor
        RewardSmoothedEvent.build(run_id="r", step=1, reward=1.0, window=2, sliding_avg=0.0, ema=0.5, slop=0.0)
    with pytest.raises(ValidationError, match=r"rewards_smoothed\.window: must be >= 1"):
        RewardSmoothedEvent.build(run_id="r", step=1, reward=1.0, window=0, sliding_avg=0.0, ema=0.5, slope=0.0)



def test_msgspec_makes_every_record_and_every_way_checks_it_alike() -> None:
    """One construction path: calling a record class is its `build` (msgspec converts the fields),
    a changed copy is built again, and msgspec called directly (decode, convert) runs the checks
    its types cannot say (storage-safe text, the rules across fields) in `__post_init__`."""
    import pickle

    import msgspec

    made = StepEvent(run_id="r", node="n", step=1, epoch=0, non_finite=["kl"], world_size=2)  # type: ignore[arg-type]
    assert (type(made.epoch), made.non_finite) == (float, ("kl",))  # as msgspec converts them, as a reader holds them
    assert made == StepEvent.build(**msgspec.structs.asdict(made)) == pickle.loads(pickle.dumps(made))
    raw = made.to_json()
    nul, rule = raw.replace(b'"node":"n"', b'"node":"n\\u0000"'), raw.replace(b'"rank":0', b'"rank":2')
    for bad, message in ((nul, r"steps\.node: holds a NUL character"), (rule, r"steps\.rank: 2 is not below world_size 2")):
        with pytest.raises(ValidationError, match=message):
            parse_event(bad)
        with pytest.raises(ValidationError, match=message):
            StepEvent(**{k: v for k, v in json.loads(bad).items() if k != "type"})
        with pytest.raises(msgspec.ValidationError, match=message):
            msgspec.json.decode(bad, type=StepEvent)
        with pytest.raises(msgspec.ValidationError, match=message):
            msgspec.convert(json.loads(bad), StepEvent)
    with pytest.raises(ValidationError, match=r"steps\.step: must be >= 0"):
        made.__replace__(step=-1)  # copy.replace's hook (Python 3.13), as `replace`
    with pytest.raises(TypeError, match=r"StepEvent\(\) takes keyword arguments only"):
        StepEvent("r", 1, 0)  # type: ignore[misc]


_SAMPLE_RECORDS = (
    StepEvent(run_id="r", step=3, epoch=0.5, reward=0.25, world_size=2, metrics={"m": 1.5}, non_finite=("kl",),
              throughput=10.0, n_samples=4, attempt=1),
    EvalEvent(run_id="r", eval_id="e", step=3, dataset="d", accuracy=0.5, verdicts=(1, 0), n_samples=2,
              samples=({"prompt": "p", "response": "r", "verdict": 1},), metrics={"pass@4": 0.5}),
    RunEvent(run_id="r", status="failed", config={"a": [1, {"b": None}]}, tags=("x",), exit_code=3),
    CommandEvent(run_id="r", command="scale_lr", args={"factor": 0.5, "from_step": 4, "restore_step": 2}, reason="why"),
    AlertEvent(run_id="r", kind="k", message="m", step=2, value=1.0, threshold=0.5),
    RewardSmoothedEvent(run_id="r", step=1, reward=0.5, window=3, sliding_avg=0.4, ema=0.3, slope=-0.1),
    CommandAckEvent(run_id="r", command_id="c1", command="scale_lr", status="ignored", step=4, lr_factor=1.0,
                    detail="no optimizer"),
)


@settings(max_examples=150, deadline=None)
@given(record=st.sampled_from(_SAMPLE_RECORDS), keep=st.lists(st.booleans(), min_size=40, max_size=40),
       extra=st.dictionaries(st.text(min_size=1, max_size=8), st.integers() | st.none() | st.text(max_size=5),
                             max_size=4))
def test_reading_a_json_object_gives_the_record_its_known_fields_build(record, keep, extra) -> None:
    """event_from_dict and parse_event equal cls(**{the object's known fields}): optional
    fields left out get their defaults (factories run), unknown keys are ignored."""
    import msgspec

    cls = type(record)
    data = json.loads(record.to_json())
    names = {f.name for f in msgspec.structs.fields(cls)}
    envelope = {"type", "run_id", "event_id", "ts", "alert_id"}  # (ids and time: random factories)
    required = {f.name for f in msgspec.structs.fields(cls) if f.required}
    data = {k: v for (k, v), kept in zip(data.items(), keep) if kept or k in envelope | required}
    data.update({k: v for k, v in extra.items() if k not in names and k != "type"})

    def outcome(build):
        try:
            return build()
        except ValidationError as err:  # a rule across fields the dropped ones broke: the same error
            return str(err)

    expected = outcome(lambda: cls(**{k: v for k, v in data.items() if k in names}))
    assert outcome(lambda: event_from_dict(data, cls)) == expected
    assert outcome(lambda: parse_event(json.dumps(data).encode())) == expected


def test_to_dict_writes_type_then_every_field_not_none_with_plain_lists_and_dicts() -> None:
    """to_dict of every record class: "type", then each field that is not None in field
    order, tuples as lists; the JSON is that dict."""
    import msgspec

    records = (*_SAMPLE_RECORDS, EvalConsensusEvent(run_id="r", eval_id="e", step=1, dataset="d", accuracy=0.5,
                                                    votes=2, replicas=3, agreement=0.5, dissenters=("n2",)),
               RejectedEvent(run_id="r", reason="why", source_topic="t", raw="{"))
    assert {type(r) for r in records} == set(EVENT_TYPES.values())
    for record in records:
        expected = {"type": record.type}
        for f in msgspec.structs.fields(record):
            v = getattr(record, f.name)
            if v is not None:
                expected[f.name] = list(v) if isinstance(v, tuple) else v
        got = record.to_dict()
        assert got == expected and list(got) == list(expected), type(record).__name__
        assert all(type(got[k]) is type(expected[k]) for k in got), type(record).__name__
        assert type(record)(**{k: v for k, v in got.items() if k != "type"}) == record
        assert json.loads(record.to_json()) == got
        assert record.to_json() == msgspec.json.encode(got), type(record).__name__  # the very bytes


@settings(max_examples=200, deadline=None)
@given(record=st.sampled_from(one_of_each() + list(_SAMPLE_RECORDS)), unset=st.lists(st.booleans(), min_size=40, max_size=40))
def test_to_json_is_the_bytes_of_to_dict_with_or_without_none_fields(record, unset) -> None:
    """A record with no None field is written by msgspec directly (type first); the same bytes."""
    import msgspec

    optional = [f.name for f in msgspec.structs.fields(record) if not f.required and f.default is None]
    changes = {name: None for name, off in zip(optional, unset) if off}
    try:
        record = record.replace(**changes)
    except ValidationError:
        return  # a rule across fields wants one of them
    assert record.to_json() == msgspec.json.encode(record.to_dict())


def test_the_type_on_the_wire_is_msgspecs_tag() -> None:
    """Each record's `type` is its msgspec tag: msgspec itself writes it first and refuses another on reading."""
    from pathlib import Path

    import msgspec

    from areal_metrics.producers.contract.events import EVENT_TYPES, parse_event

    for name, cls in EVENT_TYPES.items():
        assert (cls.type, cls.__struct_config__.tag_field, cls.__struct_config__.tag) == (name, "type", name)
    golden = Path(__file__).resolve().parent / "data" / "golden" / "events.jsonl"
    whole = 0
    for line in golden.read_bytes().splitlines():
        event = parse_event(line)
        if None not in msgspec.structs.astuple(event):  # every field set: the record as msgspec writes it
            assert msgspec.json.encode(event) == line
            whole += 1
    assert whole >= 5
    step = parse_event(golden.read_bytes().splitlines()[0])
    with pytest.raises(msgspec.ValidationError, match=r"Invalid value 'eval' - at `\$.type`"):
        msgspec.json.decode(step.to_json().replace(b'"type":"step"', b'"type":"eval"'), type=type(step))
