"""The shape of a message, fuzzed: no message stops a reader (CONTRACT.md, 'No input stops the pipeline').

Hypothesis builds arbitrary JSON (recursive objects and arrays, huge and tiny numbers,
integers past 64 bits), nesting thousands of levels deep (as the whole message, in `config`,
in `metrics`, in any field), wide objects and long arrays, duplicate keys, a wrong type in
every field, truncated bytes, odd keys and bytes that are not JSON.

- Pure (many examples): the one guard every reader decodes in (`parse_event`) raises only
  ValidationError, naming the field; the structure limits are refused before the decode with
  their reason; what it accepts, the sink can store and the worker's core can process into
  valid derived events (one validation for both).
- Broker (few examples): the same messages, for every topic and event type, through the real
  worker and sink: both stay up, each good event sent after a bad one is visible, and each bad
  one is in the dead-letter table exactly once (the sink's letter, by its log position; the
  worker's, one per bad message of the topics it reads).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import EVENT_TYPES, RewardSmoothedEvent, StepEvent, ValidationError, parse_event
from areal_metrics.producers.contract.field_rules import NUMBER_MAX
from areal_metrics.producers.contract.limits import StructureLimits, check_structure
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.sinks.decode import dead_letter_id, decode
from areal_metrics.sinks.rows import unstorable
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.processor import RunState, on_step
from tests.test_fuzz_strings import TEMPLATES
from tests.support import start_service, stop_process, wait_for

DEFAULT = StructureLimits()
# The services of the broker test run with these (AREAL_MAX_*), small enough that a wide object
# or a long array is a message of a few kilobytes
SMALL = StructureLimits(max_depth=40, max_keys=200, max_items=500)
SMALL_ENV = {"AREAL_MAX_MESSAGE_BYTES": str(SMALL.max_bytes), "AREAL_MAX_JSON_DEPTH": str(SMALL.max_depth),
             "AREAL_MAX_OBJECT_KEYS": str(SMALL.max_keys), "AREAL_MAX_ARRAY_ITEMS": str(SMALL.max_items)}

# ------------------------------------------------------------------ strategies

NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e308, -1e308, 1e100, -1e100, 1.0000000000000002e100, 5e-324, -5e-324, 2.2250738585072014e-308,
                     0.0, -0.0]),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 2**32, 2**32 - 1, 10**30]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, st.text(max_size=20))
JSON = st.recursive(SCALARS, lambda children: st.one_of(st.lists(children, max_size=5),
                                                         st.dictionaries(st.text(max_size=8), children, max_size=5)),
                    max_leaves=30)
ODD_KEYS = st.one_of(st.text(max_size=300), st.sampled_from(["", "type", "__proto__", "ключ", "\u202e", "a" * 5000]))


def _dumps(data: Any) -> bytes:
    """JSON text as a hostile writer may send it: NaN and Infinity as `json` writes them."""
    return json.dumps(data, allow_nan=True).encode()


def base(type_name: str, run_id: str = "fz-run", event_id: str = "e1") -> dict[str, Any]:
    return {"type": type_name, "schema": 1, "event_id": event_id, "run_id": run_id, "node": "n0", "rank": 0,
            "ts": 1.7e9, **TEMPLATES[type_name]}


def nested(depth: int, kind: str) -> str:
    """JSON text nested `depth` levels (an object or an array per level)."""
    if kind == "object":
        return '{"a":' * depth + "1" + "}" * depth
    return "[" * depth + "1" + "]" * depth


@st.composite
def deep_message(draw: Any, type_name: str, limits: StructureLimits = DEFAULT) -> tuple[bytes, str]:
    """A message nested deeper than the limit somewhere; (bytes, the field its reason names)."""
    depth = draw(st.one_of(st.integers(limits.max_depth + 1, limits.max_depth + 10), st.sampled_from([3000, 5000])))
    kind = draw(st.sampled_from(["object", "array"]))
    where = draw(st.sampled_from(["whole", "config", "metrics", "field"]))
    if where == "whole":  # the message itself: an object names its first key, an array nothing
        table = EVENT_TYPES[type_name].table
        return nested(depth, kind).encode(), f"{table}.a" if kind == "object" else table
    field = where if where != "field" else draw(st.sampled_from(sorted(TEMPLATES[type_name])))
    data = base(type_name)
    data.pop(field, None)
    text = json.dumps(data)[:-1] + f', "{field}": {nested(depth, kind)}}}'
    return text.encode(), f"{EVENT_TYPES[type_name].table}.{field}"


@st.composite
def hostile(draw: Any, type_name: str, run_id: str, event_id: str, limits: StructureLimits = DEFAULT) -> bytes:
    """One message of the event type's topic, of any hostile shape."""
    data = base(type_name, run_id, event_id)
    kind = draw(st.sampled_from(["json", "deep", "wide", "long", "duplicate", "wrong_type", "numbers", "truncated",
                                 "odd_key", "bytes", "missing"]))
    if kind == "json":
        return _dumps(draw(JSON))
    if kind == "deep":
        return draw(deep_message(type_name, limits))[0]
    if kind == "wide":
        field = draw(st.sampled_from(["config", "metrics", "args", "extra"]))
        n = limits.max_keys + draw(st.integers(1, 5))
        return _dumps({**data, field: {f"k{i}": i for i in range(n)}})
    if kind == "long":
        field = draw(st.sampled_from(["verdicts", "sample_ids", "tags", "dissenters", "non_finite", "extra"]))
        n = limits.max_items + draw(st.integers(1, 5))
        return _dumps({**data, field: [i % 2 for i in range(n)]})
    if kind == "duplicate":  # the same key twice: the last one is read (as `json` reads it)
        field = draw(st.sampled_from(sorted(data)))
        return _dumps(data)[:-1] + b', "' + field.encode() + b'": ' + _dumps(draw(JSON)) + b"}"
    if kind == "wrong_type":
        field = draw(st.sampled_from(sorted(data)))
        return _dumps({**data, field: draw(JSON)})
    if kind == "numbers":
        numeric = [k for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        field = draw(st.sampled_from(numeric))
        return _dumps({**data, field: draw(NUMBERS)})
    if kind == "truncated":
        raw = _dumps(data)
        return raw[: draw(st.integers(0, len(raw) - 1))]
    if kind == "odd_key":
        return json.dumps({**data, draw(ODD_KEYS): draw(JSON)}, ensure_ascii=draw(st.booleans())).encode(
            "utf-8", "surrogatepass")
    if kind == "missing":
        field = draw(st.sampled_from(["type", "event_id", "run_id", "ts"]))
        return _dumps({k: v for k, v in data.items() if k != field})
    return draw(st.binary(max_size=200))


def accepted(raw: bytes, type_name: str, limits: StructureLimits = DEFAULT) -> bool:
    try:
        parse_event(raw, expected=EVENT_TYPES[type_name], limits=limits)
        return True
    except ValidationError:
        return False


# ------------------------------------------------------------------ the pure guard

TYPE_NAMES = st.sampled_from(sorted(TEMPLATES))


@settings(max_examples=1000, deadline=None)
@given(TYPE_NAMES, st.data())
def test_the_guard_raises_only_a_validation_error_naming_the_field(type_name: str, data: st.DataObject) -> None:
    raw = data.draw(hostile(type_name, "fz-run", "e1"))
    cls = EVENT_TYPES[type_name]
    try:
        event = parse_event(raw, expected=cls)
    except ValidationError as exc:
        assert exc.where.split(".")[0].split("[")[0].removesuffix(" key") in (cls.table, "event"), str(exc)
        assert exc.problem
        return
    # accepted: the sink stores it as it is, and it reads back the same
    assert type(event) is cls
    assert unstorable(event) is None
    assert parse_event(event.to_json(), expected=cls) == event


@settings(max_examples=300, deadline=None)
@given(TYPE_NAMES, st.data())
def test_deep_nesting_anywhere_is_refused_before_the_decode_naming_the_field(type_name: str,
                                                                              data: st.DataObject) -> None:
    raw, where = data.draw(deep_message(type_name))
    with pytest.raises(ValidationError) as err:
        check_structure(raw, EVENT_TYPES[type_name].table)  # on the bytes, without a decoder
    assert str(err.value) == f"{where}: nested too deeply (more than 64 levels)"
    with pytest.raises(ValidationError, match="nested too deeply"):
        parse_event(raw, expected=EVENT_TYPES[type_name])


def test_each_structure_limit_has_its_reason_and_follows_its_setting() -> None:
    run = base("run")
    lim = StructureLimits(max_bytes=4096, max_depth=8, max_keys=30, max_items=20)
    cases = [
        (_dumps({**run, "config": {"x": "y" * 5000}}), "runs: message too large"),
        (json.dumps(run)[:-1].encode() + b', "config": ' + nested(8, "object").encode() + b"}",
         "runs.config: nested too deeply (more than 8 levels)"),
        (_dumps({**run, "config": {f"k{i}": i for i in range(31)}}), "runs.config: an object has more than 30 names"),
        (_dumps({**run, "tags": [str(i) for i in range(21)]}), "runs.tags: an array has more than 20 entries"),
        (_dumps({**run, "config": {"a": [[1] * 21]}}), "runs.config: an array has more than 20 entries"),
    ]
    for raw, reason in cases:
        with pytest.raises(ValidationError) as err:
            parse_event(raw, expected=EVENT_TYPES["run"], limits=lim)
        assert str(err.value).startswith(reason), (str(err.value), reason)
    # at the limits exactly: accepted (depth 8 = the message, config and 6 levels inside it)
    at = [_dumps({**run, "config": {f"k{i}": [0] * 20 for i in range(30)}}),
          json.dumps(run)[:-1].encode() + b', "config": ' + nested(6, "object").encode() + b"}"]
    for raw in at:
        assert parse_event(raw, limits=lim).type == "run"
    # the settings read from the environment
    env = {"AREAL_MAX_JSON_DEPTH": "9", "AREAL_MAX_OBJECT_KEYS": "100", "AREAL_MAX_ARRAY_ITEMS": "200",
           "AREAL_MAX_MESSAGE_BYTES": "5000"}
    from areal_metrics.producers.contract.settings import Settings

    s = Settings.from_env(env)
    assert (s.max_json_depth, s.max_object_keys, s.max_array_items, s.max_message_bytes) == (9, 100, 200, 5000)
    assert StructureLimits.from_settings(s) == StructureLimits(max_bytes=5000, max_depth=9, max_keys=100, max_items=200)


def test_the_entry_point_installs_the_limits_every_reader_uses(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """Nothing below the entry points reads AREAL_MAX_* (issue 43): `init` (as the worker's and the sink's
    mains and the CLI do) reads them with its Settings and installs them for parse_event."""
    from areal_metrics.producers.client.run import init
    from areal_metrics.producers.contract.limits import default_limits, install_limits

    deep = json.dumps(base("run"))[:-1].encode() + b', "config": ' + nested(9, "object").encode() + b"}"
    assert parse_event(deep).type == "run"  # within the defaults
    monkeypatch.setenv("AREAL_HOME", str(tmp_path))
    monkeypatch.setenv("AREAL_MAX_JSON_DEPTH", "9")
    assert default_limits() == DEFAULT  # set, but not read until an entry point reads it
    try:
        init(run_id="limits", mode="disabled", git=False)
        assert default_limits() == StructureLimits(max_depth=9)
        with pytest.raises(ValidationError, match=r"nested too deeply \(more than 9 levels\)"):
            parse_event(deep)
    finally:
        install_limits(DEFAULT)


def test_structure_characters_inside_strings_are_not_structure() -> None:
    run = base("run")
    text = "{[" * 2000 + "\\\"" + "]}," * 3000
    raw = _dumps({**run, "config": {"s": text, "t": ["[", "{", "\\"]}, "name": "]]]}}}"})
    assert parse_event(raw).config["s"] == text  # type: ignore[attr-defined]


def test_a_reader_dead_letters_a_5000_deep_message_and_takes_the_next() -> None:
    """The sink's decode (and so replay's): a message 5,000 levels deep is a dead letter naming
    its field, and the good message after it is a row."""
    topics = Topics("fz.")

    class M:
        def __init__(self, offset: int, value: bytes) -> None:
            self.topic, self.partition, self.offset, self.key, self.value, self.timestamp = (
                topics.runs, 0, offset, b"k", value, 1_700_000_000_000)

    deep = json.dumps(base("run"))[:-1] + ', "config": ' + nested(5000, "object") + "}"
    good = _dumps(base("run", event_id="good"))
    out = decode([M(0, deep.encode()), M(1, good)], topics)
    assert [r.event.event_id for r in out.rows] == ["good"]
    assert [d.reason for d in out.dead_letters] == ["runs.config: nested too deeply (more than 64 levels)"]
    assert out.dead_letters[0].event_id == dead_letter_id(topics.runs, 0, 0)


# ------------------------------------------------------------------ one validation

CFG = RunConfig(window=20)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(-NUMBER_MAX, NUMBER_MAX), st.integers(0, 2**62)), min_size=1, max_size=25))
def test_the_worker_derives_valid_events_from_any_numbers_the_contract_accepts(points: list[tuple[float, int]]) -> None:
    """Rewards within the number range (up to 1e100), at any steps: every smoothed point the
    core derives is a valid record (finite slope), so nothing valid fails in the worker."""
    state = RunState("fz")
    smoothed = 0
    for i, (reward, step) in enumerate(points):
        ev = StepEvent(run_id="fz", step=step, epoch=0, reward=reward, event_id=f"s{i}", ts=1.0 + i)
        state, out = on_step(state, ev, now=1.0 + i, cfg=CFG)
        for o in out:
            again = parse_event(o.event.to_json(), expected=type(o.event))  # valid for every reader
            assert unstorable(again) is None
            if isinstance(o.event, RewardSmoothedEvent):
                smoothed += 1
                assert all(math.isfinite(v) for v in (o.event.slope, o.event.ema, o.event.sliding_avg))
    assert smoothed >= 1


def test_the_values_the_issue_found_are_refused_by_every_reader_alike() -> None:
    """A year-31,000,000 `ts`, rank 7 of world_size 2, a reward of 1e308: refused by the record
    types, so the worker and the sink (both `parse_event`) refuse them alike."""
    step = base("step")
    for changes, reason in [({"ts": 31_000_000 * 365.25 * 86400}, "steps.ts: must be <= 4294967295.0"),
                            ({"rank": 7, "world_size": 2}, "steps.rank: 7 is not below world_size 2"),
                            ({"reward": 1e308}, "steps.reward: not finite or beyond +-1e+100"),
                            ({"metrics": {"m": -1e101}}, "steps.metrics")]:
        with pytest.raises(ValidationError) as err:
            parse_event(_dumps({**step, **changes}), expected=StepEvent)
        assert str(err.value).startswith(reason), str(err.value)
    with pytest.raises(ValidationError, match=r"runs.rank: 2 is not below world_size 2"):
        parse_event(_dumps({**base("run"), "rank": 2, "world_size": 2}))
    assert parse_event(_dumps({**step, "reward": 1e100, "rank": 1, "world_size": 2})).reward == 1e100


# ------------------------------------------------------------------ the real worker and sink

WORKER_READS = ("step", "eval", "run")


@pytest.fixture
def services(stack_env: dict[str, str], tmp_path: Path):
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.sinks.query import Target, connect, read_owner

    env = {**stack_env, **SMALL_ENV}
    sink = start_service("areal_metrics.sinks", env, tmp_path / "sink.log")
    settings_ = Settings(kafka_bootstrap=env["AREAL_KAFKA_BOOTSTRAP"], topic_prefix=env["AREAL_TOPIC_PREFIX"],
                         clickhouse_url=env["AREAL_CLICKHOUSE_URL"])
    store_path = Target.parse(settings_.clickhouse_url).path
    wait_for(lambda: read_owner(store_path) is not None or sink.poll() is not None, 120, "the sink to start")
    assert sink.poll() is None, (tmp_path / "sink.log").read_text()[-3000:]
    worker = start_service("areal_metrics.streams", env, tmp_path / "worker.log")

    def query(sql: str) -> list[tuple]:
        with connect(settings_, wait_s=30) as store:
            return store.query(sql).rows

    try:
        yield sink, worker, query
    finally:
        stop_process(worker)
        stop_process(sink)


ROUNDS = iter(range(1_000_000))
SENT: list[tuple[str, bool, str, int, int, str]] = []  # over the examples, which share the services


@pytest.mark.broker
@pytest.mark.timeout(1200)
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_hostile_shapes_on_every_topic_never_stop_the_worker_or_the_sink(
        data: st.DataObject, topics: Topics, kafka_bootstrap: str, services: Any, tmp_path: Path) -> None:
    from kafka import KafkaProducer

    sink, worker, query = services
    n = next(ROUNDS)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", max_request_size=2 << 20)
    sent = SENT  # (type, accepted, topic, partition, offset, good event_id)
    try:
        for type_name in sorted(TEMPLATES):
            for i in range(data.draw(st.integers(2, 4), label=f"{type_name} messages")):
                tag = f"{n}-{type_name.replace('_', '-')}-{i}"
                bad = data.draw(hostile(type_name, f"fz-h{tag}", f"h{tag}", SMALL), label=f"{type_name} {i}")
                good = _dumps(base(type_name, f"fz-g{tag}", f"g{tag}"))
                topic = topics.for_event(EVENT_TYPES[type_name])
                key = f"fz-{type_name}".encode()
                # a producer sets the log time it likes (2**50 ms: the year 37,648)
                when = data.draw(st.sampled_from([None, None, 2**50]), label="timestamp_ms")
                where = producer.send(topic, key=key, value=bad, timestamp_ms=when).get(60)
                after = producer.send(topic, key=key, value=good).get(60)
                assert after.partition == where.partition
                sent.append((type_name, accepted(bad, type_name, SMALL), topic, where.partition, where.offset,
                             f"g{tag}"))
    finally:
        producer.close(30)

    for type_name in sorted(TEMPLATES):  # every good event after a bad one is visible
        table = EVENT_TYPES[type_name].table
        goods = [s[5] for s in sent if s[0] == type_name]
        ids = ", ".join(f"'{g}'" for g in goods)
        wait_for(lambda: query(f"SELECT uniqExact(event_id) FROM {table} WHERE event_id IN ({ids})")[0][0]
                 == len(goods), 300, f"every good {type_name} event after a hostile one")
    # every refused message: one dead letter from the sink, by its log position, stored once
    letters = [dead_letter_id(topic, p, o) for _, ok, topic, p, o, _ in sent if not ok]
    if letters:
        ids = ", ".join(f"'{d}'" for d in letters)
        wait_for(lambda: query(f"SELECT uniqExact(event_id) FROM deadletter WHERE event_id IN ({ids})")[0][0]
                 == len(letters), 300, "the sink's dead letters")
        rows = query(f"SELECT event_id, count() FROM deadletter FINAL WHERE event_id IN ({ids}) GROUP BY event_id")
        assert sorted(c for _, c in rows) == [1] * len(letters)
        reasons = query(f"SELECT reason FROM deadletter FINAL WHERE event_id IN ({ids})")
        assert all(": " in r for (r,) in reasons), reasons
    # the worker: one dead letter for each refused message of the topics it reads
    for type_name in WORKER_READS:
        source = topics.for_event(EVENT_TYPES[type_name])
        refused = sum(1 for t, ok, *_ in sent if t == type_name and not ok)
        wait_for(lambda: query(f"SELECT uniqExact(event_id) FROM deadletter WHERE node = 'areal-streams' "
                               f"AND source_topic = '{source}'")[0][0] == refused, 300,
                 f"the worker's {refused} dead letters of {type_name}")
    assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
    assert sink.poll() is None, (tmp_path / "sink.log").read_text()[-3000:]


def test_a_log_time_past_what_ts_holds_still_gives_a_dead_letter() -> None:
    """A producer sets the Kafka timestamp it likes: the dead letter of its bad message is still
    made (its `ts` held within the contract's range) by the sink and by the worker."""
    import asyncio

    from areal_metrics.producers.contract.field_rules import TS_MAX
    from areal_metrics.streams.core.config import StreamsConfig
    from areal_metrics.streams.shell.batch import Input, StreamCore

    topics = Topics("fz.")

    class M:
        topic, partition, offset, key, value, timestamp = topics.steps, 0, 7, b"k", b"{not json", 2**62

    [letter] = decode([M()], topics).dead_letters
    assert letter.ts == TS_MAX and letter.reason.startswith("event: not valid JSON")
    sent: list[tuple[str, bytes]] = []

    async def send(topic: str, key: bytes, value: bytes) -> Any:
        sent.append((topic, value))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    worker = StreamCore(topics=topics, config=StreamsConfig(), table={}, send=send)
    asyncio.run(worker.on_batch([Input(topics.steps, 0, 7, b"k", b"{not json", 1e15),
                                 Input(topics.steps, 0, 8, b"k", _dumps(base("step", event_id="after")), 1e15)]))
    letters = [parse_event(v) for t, v in sent if t == topics.deadletter]
    assert [x.ts for x in letters] == [TS_MAX]
    assert any(t == topics.smoothed for t, _ in sent)  # the good step after it went through
    assert worker.stats["errors"] == 0
