"""Hostile input to every reader: random bytes, deep JSON, huge strings, wrong
types and boundary numbers. Each message is processed or dead-lettered with a
reason that names the field; no reader crashes; memory stays bounded.

Readers: the stream worker's per-message logic (`areal_metrics.streams.shell.app.StreamCore`, the
code its Faust agents call), the sink's decoder (`areal_metrics.sinks.decode.decode`), the
CLI's argument parsing, and the two config files (stream worker, trainer).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import math
import re
import tracemalloc
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import EVENT_TYPES, RejectedEvent, parse_event
from areal_metrics.producers.contract.topics import Topics

TOPICS = Topics("areal.")
REASON = re.compile(r"^[a-z_.]+(\.[A-Za-z0-9_]+|\[\d+\])*( key)?: .+")  # "steps.reward: not finite (nan)"

VALID_STEP = {"type": "step", "schema": 1, "event_id": "e-1", "run_id": "run-1", "node": "n0", "rank": 0,
              "ts": 1.7e9, "step": 3, "epoch": 0, "reward": 0.5}
VALID_EVAL = {"type": "eval", "schema": 1, "event_id": "e-2", "run_id": "run-1", "node": "n0", "rank": 0,
              "ts": 1.7e9, "eval_id": "r1", "step": 3, "dataset": "add_1digit", "stage": "full", "status": "ok",
              "accuracy": 0.5, "verdicts": [1, 0], "n_samples": 2, "replicas": 3}

boundary_numbers = st.sampled_from([0, -1, 1, 2**31, 2**63, -(2**63), 2**64, 10**400, 1e308, -1e308, 5e-324,
                                    0.0, -0.0, 1.0000001, float("nan"), float("inf"), -float("inf")])
wrong_types = st.one_of(st.none(), st.booleans(), st.text(max_size=20), st.lists(st.integers(), max_size=3),
                        st.dictionaries(st.text(max_size=5), st.integers(), max_size=3), boundary_numbers)


def mutated(base: dict) -> st.SearchStrategy[bytes]:
    """A valid event with one field replaced, removed or added."""
    keys = st.sampled_from(sorted(base) + ["extra", "metrics", "verdicts"])

    def build(key: str, value: object, drop: bool) -> bytes:
        data = dict(base)
        if drop:
            data.pop(key, None)
        else:
            data[key] = value
        return json.dumps(data, allow_nan=True).encode()

    return st.builds(build, keys, wrong_types, st.booleans())


def deep_json(depth: int) -> bytes:
    return ("[" * depth + "]" * depth).encode()


hostile = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    mutated(VALID_STEP),
    mutated(VALID_EVAL),
    st.integers(min_value=1, max_value=200_000).map(deep_json),
    st.integers(min_value=1, max_value=3 << 20).map(lambda n: json.dumps({**VALID_STEP, "node": "x" * n}).encode()),
    st.just(b"\xff\xfe\x00garbage"),
    st.just(b""),
)


@dataclass
class Sent:
    topic: str
    key: bytes
    value: bytes


def stream_core(sent: list[Sent]):
    from areal_metrics.streams.shell.app import StreamCore
    from areal_metrics.streams.core.config import StreamsConfig

    async def send(topic: str, key: bytes, value: bytes):
        sent.append(Sent(topic, key, value))
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    return StreamCore(topics=TOPICS, config=StreamsConfig(), table={}, send=send)


def check_outcome(raw: bytes, sent: list[Sent], topic: str) -> None:
    """Processed (valid input) or exactly one dead letter naming the field."""
    try:
        parse_event(raw, expected=TOPICS.event_type(topic))
        valid = True
    except ValueError:
        valid = False
    dead = [parse_event(s.value) for s in sent if s.topic == TOPICS.deadletter]
    for s in sent:  # everything a reader writes is itself a valid event
        assert parse_event(s.value).type in EVENT_TYPES
    if valid:
        assert not dead
    else:
        assert len(dead) == 1 and isinstance(dead[0], RejectedEvent)
        assert REASON.match(dead[0].reason) or dead[0].reason.startswith("event"), dead[0].reason
        assert dead[0].source_topic == topic


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(raw=hostile, to_evals=st.booleans())
def test_stream_worker_processes_or_dead_letters_everything(raw, to_evals):
    topic = TOPICS.evals if to_evals else TOPICS.steps
    sent: list[Sent] = []
    core = stream_core(sent)
    asyncio.run(core.on_input(topic, 0, 7, b"run-1", raw, timestamp=1.7e9))
    assert core.stats["errors"] == 0  # bad input is never a worker error
    check_outcome(raw, sent, topic)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(raws=st.lists(hostile, min_size=1, max_size=5), to_evals=st.booleans())
def test_sink_stores_or_dead_letters_every_message(raws, to_evals):
    from areal_metrics.sinks.decode import decode

    @dataclass
    class Msg:
        topic: str
        partition: int
        offset: int
        key: bytes | None
        value: bytes | None
        timestamp: int

    topic = TOPICS.evals if to_evals else TOPICS.steps
    decoded = decode([Msg(topic, 0, i, b"run-1", raw, 1_700_000_000_000) for i, raw in enumerate(raws)], TOPICS)
    assert len(decoded.rows) + len(decoded.dead_letters) == len(raws)
    for dead in decoded.dead_letters:
        assert isinstance(dead, RejectedEvent) and ": " in dead.reason


def test_memory_stays_bounded_under_a_flood_of_hostile_messages():
    """2,000 bad messages of up to 512 KiB each: the worker retains (almost) nothing of them."""
    sent: list[Sent] = []
    core = stream_core(sent)
    big = json.dumps({**VALID_STEP, "reward": "x" * (512 << 10)}).encode()
    samples = [big, deep_json(100_000), b"\xff" * 4096, json.dumps({**VALID_STEP, "step": -1}).encode()]

    async def flood(n: int) -> None:
        for i in range(n):
            await core.on_input(TOPICS.steps, 0, i, f"run-{i % 7}".encode(), samples[i % len(samples)], 1.7e9)
            sent.clear()  # what is sent leaves the process

    asyncio.run(flood(200))  # warm up caches and per-run state
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    asyncio.run(flood(2000))
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    growth = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert core.stats["rejected"] == 2200 and core.stats["errors"] == 0
    assert growth < 2 << 20, f"retained {growth / 2**20:.1f} MiB"


@settings(max_examples=150, deadline=None)
@given(args=st.lists(st.one_of(st.text(max_size=12), st.sampled_from(["--x", "-", "--", "\x00", "💥", "--format"])),
                     max_size=4),
       verb=st.sampled_from(["sql", "alerts", "status", "replay", "report", "grafana", "watch", "train", "up",
                             "publish"]))
def test_cli_arguments_never_give_a_traceback(args, verb):
    """Random arguments: a usage error is one line and exit 2; nothing raises."""
    from areal_metrics.cli import build_parser

    parser = build_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args([verb, *args])
            code = 0
        except SystemExit as exc:
            code = exc.code
    if code not in (0, None):
        assert code == 2
        assert len(err.getvalue().strip().splitlines()) == 1


@settings(max_examples=200, deadline=None)
@given(data=st.one_of(st.dictionaries(st.sampled_from(["defaults", "runs", "tick_interval_s", "bogus"]),
                                 st.one_of(wrong_types, st.dictionaries(
                                     st.sampled_from(["window", "ema_alpha", "reward_threshold", "stall_seconds",
                                                      "run-*", "nope"]), wrong_types, max_size=3)),
                                 max_size=3),
                 wrong_types))
def test_stream_config_files_are_accepted_or_refused_with_the_field(tmp_path_factory, data):
    from areal_metrics.streams.core.config import ConfigError, StreamsConfig

    path = tmp_path_factory.mktemp("cfg") / "streams.json"
    path.write_text(json.dumps(data, allow_nan=True))
    try:
        config = StreamsConfig.load(path)
    except ConfigError as exc:
        assert str(exc) and "\n" not in str(exc)
    else:
        cfg = config.for_run("run-1")
        assert cfg.window >= 1 and math.isfinite(cfg.ema_alpha)


@settings(max_examples=200, deadline=None)
@given(data=st.dictionaries(st.sampled_from(["lr", "group_size", "eval_every_steps", "device", "advantage",
                                        "eval_datasets", "bogus", "seed", "clip_eps"]), wrong_types, max_size=4))
def test_train_config_files_are_accepted_or_refused_with_the_key(tmp_path_factory, data):
    from areal_metrics.areal_train.config import ConfigError, load

    path = tmp_path_factory.mktemp("cfg") / "train.json"
    path.write_text(json.dumps(data, allow_nan=True))
    try:
        cfg = load(path)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and any(key in message for key in data) or "config" in message
    else:
        assert cfg.lr > 0 and cfg.group_size >= 2


def test_config_file_that_is_not_json_is_refused(tmp_path):
    from areal_metrics.areal_train.config import ConfigError, load
    from areal_metrics.streams.core.config import ConfigError as StreamsConfigError
    from areal_metrics.streams.core.config import StreamsConfig

    path = tmp_path / "bad.json"
    path.write_bytes(b"\xff{not json")
    with pytest.raises(ConfigError):
        load(path)
    with pytest.raises(StreamsConfigError):
        StreamsConfig.load(path)


_log_times = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.just(32503680000.0))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ts=_log_times, key=st.one_of(st.none(), st.binary(max_size=300)), raw=hostile)
def test_a_poison_message_is_dead_lettered_by_the_worker_whatever_its_log_time_key_or_value(ts, key, raw):
    """The message that stopped the worker twice (producers/runtime/poison.py) gets its dead letter and its
    alert whatever its producer set: a year-3000 timestamp once made the poison path itself raise."""
    from areal_metrics.producers.contract.events import AlertEvent
    from areal_metrics.streams.shell.batch import Input

    sent: list[Sent] = []
    asyncio.run(stream_core(sent).on_poison(Input(TOPICS.steps, 0, 7, key, raw, ts), 2))
    events = [parse_event(s.value) for s in sent]
    assert [type(e) for e in events] == [RejectedEvent, AlertEvent] and events[1].kind == "poison_message"
    assert [s.topic for s in sent] == [TOPICS.deadletter, TOPICS.alerts]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(ts=st.one_of(st.none(), st.integers(-2, 2**63 - 1)), key=st.one_of(st.none(), st.binary(max_size=300)), raw=hostile)
def test_a_poison_message_is_dead_lettered_by_the_sink_whatever_its_log_time_key_or_value(tmp_path_factory, ts, key, raw):
    from types import SimpleNamespace

    from areal_metrics.producers.runtime.poison import CrashGuard
    from areal_metrics.sinks.batching import Chunk
    from areal_metrics.sinks.sink import Sink

    folder = tmp_path_factory.mktemp("guard")
    (folder / "suspects.json").write_text(json.dumps([[TOPICS.steps, 0, 7, 7, 2]]))  # crashed twice at offset 7
    guard = CrashGuard(folder, limit=2, service="sink")
    guard.start()
    sink = Sink.__new__(Sink)  # the decoding step alone: no broker, no store
    sink.guard, sink.topics, sink.crash_marker, sink.stats = guard, TOPICS, None, {"poison": 0}
    m = SimpleNamespace(topic=TOPICS.steps, partition=0, offset=7, key=key, value=raw, timestamp=ts)  # ms, as kafka-python
    alerts: list = []
    decoded = sink._decode(Chunk(TOPICS.steps, 0, 7, 7, (m,)), alerts)
    assert [type(d) for d in decoded.dead_letters] == [RejectedEvent] and [a.kind for a in alerts] == ["poison_message"]
    assert sink.stats["poison"] == 1


def test_valid_events_whose_alert_would_quote_a_long_text_still_raise_it_cut_to_the_message_limit():
    """An alert's message quotes a user's text (a failed eval's error, an ignored command's detail, a dead
    letter's reason): at the fields' own limit the alert used to break its rule, so the valid event
    behind it was dead-lettered and the alert lost."""
    from areal_metrics.producers.contract.events import AlertEvent, CommandAckEvent, EvalEvent
    from areal_metrics.producers.contract.field_rules import CUT_MARK, MESSAGE_MAX

    sent: list[Sent] = []
    core = stream_core(sent)
    trace = ("Traceback (most recent call last):\n" + '  File "eval.py", line 1, in run\n' * 200)[:MESSAGE_MAX]
    failed = EvalEvent(run_id="r1", eval_id="e1", step=10, dataset="gsm8k", status="failed", error=trace, ts=1.0)
    ignored = CommandAckEvent(run_id="r2", command_id="c1", command="scale_lr", status="ignored", detail="y" * MESSAGE_MAX,
                              ts=1.0)
    unknown = json.dumps({"type": "x" * 5000, "event_id": "e", "run_id": "r3", "ts": 1}).encode()
    asyncio.run(core.on_input(TOPICS.evals, 0, 1, b"r1", failed.to_json(), 1.0))
    asyncio.run(core.on_input(TOPICS.acks, 0, 2, b"r2", ignored.to_json(), 1.0))
    asyncio.run(core.on_input(TOPICS.steps, 0, 3, b"r3", unknown, 1.0))
    events = [parse_event(s.value) for s in sent]
    alerts = {e.kind: e for e in events if isinstance(e, AlertEvent)}
    assert {"eval_failed", "command_ignored", "invalid_event"} <= set(alerts)
    for kind in ("eval_failed", "command_ignored"):
        assert len(alerts[kind].message) == MESSAGE_MAX and alerts[kind].message.endswith(CUT_MARK)
    dead = [e for e in events if isinstance(e, RejectedEvent)]
    assert [d.run_id for d in dead] == ["r3"] and dead[0].reason.startswith("event.type: unknown event type")
    assert core.stats["errors"] == 0
