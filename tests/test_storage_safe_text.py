"""One storage-safe text rule for every string a reader takes, and the client's normalisation.

No broker, no store: the rule itself (`field_rules.text_problem`), each place a string sits in
an event (fields, list entries, `metrics` names, config/args keys and values at depth, sample
text), the `metrics` cap, the dead letter's `raw`, and what the client makes of such text.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.client import coerce
from areal_metrics.producers.contract.deadletter import raw_as_text, rejected
from areal_metrics.producers.contract.events import ValidationError, parse_event
from areal_metrics.producers.contract.field_rules import METRICS_MAX, storage_safe, text_problem

STEP = {"type": "step", "schema": 1, "event_id": "e1", "run_id": "r1", "node": "n0", "rank": 0, "ts": 1.7e9,
        "step": 1, "epoch": 0}
RUN = {"type": "run", "schema": 1, "event_id": "e2", "run_id": "r1", "node": "n0", "rank": 0, "ts": 1.7e9,
       "status": "running"}
EVAL = {"type": "eval", "schema": 1, "event_id": "e3", "run_id": "r1", "node": "n0", "rank": 0, "ts": 1.7e9,
        "eval_id": "x", "step": 1, "dataset": "d", "accuracy": 0.5}


def refusal(data: dict) -> str | None:
    try:
        parse_event(json.dumps(data).encode())
    except ValidationError as err:
        return str(err)
    return None


@pytest.mark.parametrize("text,problem", [
    ("ok", None), ("a\u202eb", None), ("\U0001F600", None), ("", None),
    ("a\x00b", "holds a NUL character (at index 1)"),
    ("ab\ud800", "holds a lone surrogate U+D800 (at index 2), which UTF-8 cannot encode"),
    ("\udfff", "holds a lone surrogate U+DFFF (at index 0), which UTF-8 cannot encode"),
])
def test_the_rule(text: str, problem: str | None) -> None:
    assert text_problem(text) == problem


@pytest.mark.parametrize("base,changes,where", [
    (STEP, {"node": "n\x00"}, "steps.node"),
    (STEP, {"event_id": "e\ud800"}, "steps.event_id"),
    (STEP, {"metrics": {"\ud800": 1.0}}, "steps.metrics key"),
    (STEP, {"non_finite": ["kl", "\x00"]}, "steps.non_finite[1]"),
    (RUN, {"tags": ["\udc00"]}, "runs.tags[0]"),
    (RUN, {"group": "g\x00"}, "runs.group"),
    (RUN, {"config": {"a": {"b": ["x", "\ud800"]}}}, "runs.config.a.b[1]"),
    (RUN, {"config": {"a": {"k\x00": 1}}}, "runs.config.a key"),
    (EVAL, {"dataset": "\ud800"}, "evals.dataset"),
    (EVAL, {"samples": [{"prompt": "p", "response": "\x00"}]}, "evals.samples[0].response"),
    (EVAL, {"metrics": {"pass@1\x00": 0.5}}, "evals.metrics key"),
])
def test_every_place_a_string_sits_is_checked_and_named(base: dict, changes: dict, where: str) -> None:
    reason = refusal({**base, **changes})
    assert reason is not None and reason.startswith(f"{where}: holds a "), reason


def test_the_metrics_cap_and_the_key_cap() -> None:
    assert refusal({**STEP, "metrics": {f"m{i}": 1.0 for i in range(METRICS_MAX)}}) is None
    assert refusal({**STEP, "metrics": {f"m{i}": 1.0 for i in range(METRICS_MAX + 1)}}) == \
        f"steps.metrics: more than {METRICS_MAX} names"
    assert refusal({**RUN, "config": {"k" * 257: 1}}) == "runs.config key: longer than 256 chars (257)"


@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=()), max_size=40), field=st.sampled_from(
    ["node", "event_id", "metric", "tag", "config_value", "config_key", "sample"]))
def test_a_reader_accepts_text_exactly_when_the_rule_does(text: str, field: str) -> None:
    """Any text (surrogates, NUL, controls, astral characters) in any place: accepted iff safe."""
    if field == "node":
        data = {**STEP, "node": text or "n"}
    elif field == "event_id":
        data = {**STEP, "event_id": text or "e"}
    elif field == "metric":
        data = {**STEP, "metrics": {text or "m": 1.0}}
    elif field == "tag":
        data = {**RUN, "tags": [text]}
    elif field == "config_value":
        data = {**RUN, "config": {"k": [text]}}
    elif field == "config_key":
        data = {**RUN, "config": {text: 1}}
    else:
        data = {**EVAL, "samples": [{"prompt": text, "response": "r"}]}
    assert (refusal(data) is None) == (text_problem(text) is None)


@given(text=st.text(max_size=40))
def test_normalised_text_is_always_safe_and_safe_text_is_kept(text: str) -> None:
    out = storage_safe(text)
    assert text_problem(out) is None and len(out) == len(text)
    if text_problem(text) is None:
        assert out == text


def test_the_client_normalises_instead_of_raising() -> None:
    assert coerce.metric_name("a\x00\ud800") == "a\ufffd\ufffd"
    parts = coerce.split_step({f"m{i}": float(i) for i in range(METRICS_MAX + 10)})
    assert len(parts.metrics) == METRICS_MAX and "m0" in parts.metrics and f"m{METRICS_MAX}" not in parts.metrics
    assert coerce.config({"k\ud800": ["v\x00"]}) == {"k\ufffd": ["v\ufffd"]}
    records, _ = coerce.samples([{"prompt": "p\x00", "response": "\udc80"}])
    assert records[0]["prompt"] == "p\ufffd" and records[0]["response"] == "\ufffd"


def test_a_dead_letter_keeps_raw_text_it_could_not_store_as_base64() -> None:
    assert raw_as_text(b'{"a":1}') == '{"a":1}'
    assert raw_as_text(b'{"a":"\\ud800"}') == '{"a":"\\ud800"}'  # the escape is ASCII text
    assert raw_as_text(b"a\x00b") == "base64:YQBi"
    assert raw_as_text("x\ud800") == "base64:eO2ggA=="
    assert raw_as_text(b"\xff") == "base64:/w=="
    dead = rejected(b"a\x00b", "steps.node: holds a NUL character (at index 1)", "areal.steps", node="n")
    assert dead.raw == "base64:YQBi"
    assert text_problem(rejected(b"{}", "why \ud800", "t", node="n").reason) is None
