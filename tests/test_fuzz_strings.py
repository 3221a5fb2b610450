"""Hostile strings in every string field of every topic, through the real worker and sink.

For each event type, each field that holds text (strings, list entries, `metrics` names, the
keys and values of config/args, sample text) gets each hostile value: a lone surrogate (as a
JSON escape, and as raw bytes, which are not UTF-8), NUL, bidi controls, 4-byte characters
(escaped and raw), text past its cap, and many keys or entries. After each hostile event a
good one goes to the same partition (same key; each event names its own run). Checks:

- every hostile event is stored (the contract accepts it) or dead-lettered by the sink
  (exactly one dead letter, by its log position), and the counts add up; the worker
  dead-letters exactly the invalid ones of the topics it reads;
- every good event sent after a hostile one becomes visible;
- the worker and the sink are still running at the end.

The oracle is the contract itself (`parse_event`): the test checks that the readers act on
its verdict and that nothing it accepts fails to store.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from areal_metrics.producers.contract.events import EVENT_TYPES, ValidationError, parse_event
import msgspec.inspect as mi
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.sinks.decode import dead_letter_id
from tests.support import start_service, stop_process, wait_for

pytestmark = [pytest.mark.broker, pytest.mark.timeout(900)]

WORKER_READS = ("step", "eval", "run")  # the topics the stream worker consumes

TEMPLATES: dict[str, dict[str, Any]] = {
    "step": {"step": 1, "epoch": 0, "reward": 0.5, "metrics": {"m": 1.0}, "non_finite": ["kl"]},
    "eval": {"eval_id": "r1", "step": 1, "dataset": "math500", "stage": "full", "status": "ok", "accuracy": 0.5,
             "n_samples": 2, "verdicts": [1, 0], "replicas": 1, "dataset_fingerprint": "fp", "error": "",
             "metrics": {"pass@1": 0.5}, "samples": [{"prompt": "p", "response": "r", "verdict": 1}]},
    "eval_consensus": {"eval_id": "r1", "step": 1, "dataset": "math500", "stage": "full", "accuracy": 0.5,
                       "votes": 1, "replicas": 1, "agreement": 1.0, "dissenters": ["n1"]},
    "reward_smoothed": {"step": 1, "reward": 0.5, "window": 5, "sliding_avg": 0.5, "ema": 0.5, "slope": 0.0},
    "command": {"command": "evaluate_now", "target_node": "n0", "args": {"a": "b"}, "reason": "r"},
    "alert": {"alert_id": "a1", "kind": "stalled", "severity": "warning", "message": "m"},
    "rejected": {"reason": "r", "source_topic": "t", "raw": "x"},
    "run": {"status": "running", "config": {"lr": 0.1, "name": "x"}, "tags": ["t"], "group": "g", "host": "h",
            "framework": "f", "git_commit": "c"},
}

# (name, text, raw UTF-8 in the message rather than JSON escapes)
HOSTILE_TEXT = [
    ("surrogate", "a\ud800b", False),
    ("surrogate_bytes", "a\udfffb", True),  # surrogatepass bytes: not UTF-8
    ("nul", "a\x00b", False),
    ("bidi", "a\u202eb\u2066c\u2069", True),
    ("astral", "a\U0001F600\U00010348", True),
    ("astral_escaped", "\U0001F600", False),
    ("oversize", "x" * 5000, False),
    ("huge", "y" * 300_000, False),
]


def _text_kind(t: mi.Type) -> str | None:
    """The kind of text a field of msgspec type `t` holds (None: no text)."""
    if isinstance(t, mi.UnionType):  # `X | None`
        return next((k for k in map(_text_kind, t.types) if k), None)
    if isinstance(t, mi.StrType):
        return "str"
    if isinstance(t, mi.VarTupleType):
        if isinstance(t.item_type, mi.StrType):
            return "str_list"
        return "sample_list" if isinstance(t.item_type, mi.DictType) else None
    if isinstance(t, mi.DictType):
        return "float_map" if isinstance(t.value_type, mi.FloatType) else "json_map"
    return None


def text_fields(type_name: str) -> list[tuple[str, str]]:
    """(field, kind) of every field of the type that holds text."""
    info = mi.type_info(EVENT_TYPES[type_name])
    return [(f.name, kind) for f in info.fields if (kind := _text_kind(f.type))]


def hostile_values(kind: str) -> Iterator[tuple[str, Any, bool]]:
    """(label, value, raw UTF-8) for a field of `kind`."""
    for name, text, raw in HOSTILE_TEXT:
        if kind == "str":
            yield name, text, raw
        elif kind == "str_list":
            yield name, ["ok", text], raw
        elif kind == "float_map":
            yield name, {"ok": 1.0, text[:300]: 2.0}, raw
        elif kind == "json_map":
            yield f"{name}_value", {"k": text}, raw
            yield f"{name}_key", {text[:300]: 1}, raw
        elif kind == "sample_list":
            yield name, [{"prompt": text, "response": "r", "verdict": 1}], raw
    if kind == "float_map":
        yield "many_keys", {f"m{i}": float(i) for i in range(1500)}, False
    elif kind == "json_map":
        yield "many_keys", {f"k{i}": i for i in range(1500)}, False
    elif kind == "str_list":
        yield "many_entries", [f"e{i}" for i in range(2000)], False


def message(type_name: str, run_id: str, event_id: str, changes: dict[str, Any], raw_utf8: bool) -> bytes:
    data = {"type": type_name, "schema": 1, "event_id": event_id, "run_id": run_id, "node": "n0", "rank": 0,
            "ts": 1.7e9, **TEMPLATES[type_name], **changes}
    if raw_utf8:
        return json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(data).encode()


def cases() -> list[tuple[str, str, bytes, bytes]]:
    """(type, label, hostile message, the good message after it), over every text field and value."""
    out = []
    for type_name in TEMPLATES:
        run_id = f"fz-{type_name.replace('_', '-')}"
        for name, kind in text_fields(type_name):
            for label, value, raw in hostile_values(kind):
                n = len(out)
                # each event its own run (the Kafka key stays the type's): the tables' sort keys
                # start with run_id, and a merge would collapse events that share one
                hostile = message(type_name, f"{run_id}-h{n}", f"h{n}", {name: value}, raw)
                good = message(type_name, f"{run_id}-g{n}", f"g{n}", {}, False)
                out.append((type_name, f"{type_name}.{name}:{label}", hostile, good))
    random.Random(30).shuffle(out)  # the topics interleave; each good event still follows its hostile one
    return out


def test_the_cases_cover_every_text_field_and_accept_and_refuse_some_of_each() -> None:
    all_cases = cases()
    labels = {label for _, label, _, _ in all_cases}
    for type_name in TEMPLATES:
        parse_event(message(type_name, "r", "e", {}, False))  # the templates are valid
        for name, _ in text_fields(type_name):
            assert any(label.startswith(f"{type_name}.{name}:") for label in labels)
    verdicts = [valid(hostile, t) for t, _, hostile, _ in all_cases]
    assert 0 < sum(verdicts) < len(verdicts)


def valid(raw: bytes, type_name: str) -> bool:
    try:
        parse_event(raw, expected=EVENT_TYPES[type_name])
        return True
    except ValidationError:
        return False


@pytest.fixture
def sink_process(stack_env: dict[str, str], tmp_path: Path):
    from areal_metrics.sinks.query import Target, connect, read_owner

    proc = start_service("areal_metrics.sinks", stack_env, tmp_path / "sink.log")
    settings = Settings(kafka_bootstrap=stack_env["AREAL_KAFKA_BOOTSTRAP"], topic_prefix=stack_env["AREAL_TOPIC_PREFIX"],
                        clickhouse_url=stack_env["AREAL_CLICKHOUSE_URL"])
    store_path = Target.parse(settings.clickhouse_url).path
    wait_for(lambda: read_owner(store_path) is not None or proc.poll() is not None, 120, "the sink to start")
    assert proc.poll() is None, (tmp_path / "sink.log").read_text()[-3000:]

    def query(sql: str) -> list[tuple]:
        with connect(settings, wait_s=30) as store:
            return store.query(sql).rows

    try:
        yield proc, query
    finally:
        stop_process(proc)


def test_every_hostile_string_is_stored_or_dead_lettered_and_never_stalls_its_partition(
        stack_env: dict[str, str], topics: Topics, kafka_bootstrap: str, sink_process, tmp_path: Path) -> None:
    from kafka import KafkaProducer

    sink, query = sink_process
    worker = start_service("areal_metrics.streams", stack_env, tmp_path / "worker.log")
    try:
        producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", max_request_size=2 << 20)
        sent = []  # (type, label, valid, topic, partition, offset, event_id of the hostile, of the good)
        for type_name, label, hostile, good in cases():
            topic = topics.for_event(EVENT_TYPES[type_name])
            key = f"fz-{type_name.replace('_', '-')}".encode()
            where = producer.send(topic, key=key, value=hostile).get(60)
            after = producer.send(topic, key=key, value=good).get(60)
            assert after.partition == where.partition
            sent.append((type_name, label, valid(hostile, type_name), topic, where.partition, where.offset,
                         json.loads(hostile.decode("utf-8", "surrogatepass"))["event_id"],
                         json.loads(good)["event_id"]))
        producer.close(30)

        tables = {t: EVENT_TYPES[t].table for t in TEMPLATES}
        # every good event becomes visible
        for type_name, table in tables.items():
            goods = {g: label for t, label, *_, g in sent if t == type_name}
            ids = ", ".join(f"'{g}'" for g in goods)
            try:
                wait_for(lambda: query(f"SELECT uniqExact(event_id) FROM {table} WHERE event_id IN ({ids})")[0][0]
                         == len(goods), 300, f"every good {type_name} event after a hostile one")
            except AssertionError:
                seen = {e for (e,) in query(f"SELECT DISTINCT event_id FROM {table} WHERE event_id IN ({ids})")}
                raise AssertionError(f"not visible after their hostile event: "
                                     f"{sorted(label for g, label in goods.items() if g not in seen)}") from None
        # every hostile one is stored (valid) or has exactly one dead letter from the sink (invalid)
        for type_name, table in tables.items():
            mine = [s for s in sent if s[0] == type_name]
            accepted = [s[6] for s in mine if s[2]]
            letters = {dead_letter_id(topic, p, o): label for t, label, ok, topic, p, o, _, _ in mine if not ok}
            if accepted:
                ids = ", ".join("'" + e.replace("\\", "\\\\").replace("'", "\\'") + "'" for e in accepted)
                stored = query(f"SELECT uniqExact(event_id) FROM {table} WHERE event_id IN ({ids})")[0][0]
                assert stored == len(accepted), f"{type_name}: {stored} of {len(accepted)} accepted events stored"
            if letters:
                ids = ", ".join(f"'{d}'" for d in letters)
                wait_for(lambda: query(f"SELECT uniqExact(event_id) FROM deadletter WHERE event_id IN ({ids})")[0][0]
                         == len(letters), 120, f"the sink's dead letters of {type_name}")
                reasons = query(f"SELECT event_id, reason FROM deadletter WHERE event_id IN ({ids})")
                assert all(": " in reason for _, reason in reasons), reasons
        # the worker dead-letters exactly the invalid events of the topics it reads
        for type_name in WORKER_READS:
            invalid = sum(1 for s in sent if s[0] == type_name and not s[2])
            source = topics.for_event(EVENT_TYPES[type_name])
            wait_for(lambda: query(f"SELECT uniqExact(event_id) FROM deadletter WHERE node = 'areal-streams' "
                                   f"AND source_topic = '{source}'")[0][0] == invalid, 120,
                     f"the worker's {invalid} dead letters of {type_name}")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        assert sink.poll() is None, (tmp_path / "sink.log").read_text()[-3000:]
    finally:
        stop_process(worker)
