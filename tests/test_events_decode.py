"""parse_event reads JSON through orjson where it can: the records and the errors must be
exactly what the standard library's json gives (the readers' behaviour does not change)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract import events
from areal_metrics.producers.contract.events import StepEvent, ValidationError, parse_event

pytestmark = pytest.mark.skipif(events.orjson is None, reason="orjson not installed")

NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**19, -(10**19), 1e308, 5e-324, 0.1]))
TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["\ud800", "ключ", "\x00", "a\nb"]))


def outcome(raw: bytes) -> Any:
    try:
        return parse_event(raw, expected=StepEvent).to_dict()
    except ValidationError as err:
        return f"error: {err}"


@st.composite
def step_json(draw: Any) -> bytes:
    body: dict[str, Any] = {"type": "step", "run_id": draw(st.sampled_from(["r1", "bad id"])), "event_id": "e",
                            "ts": draw(NUMBERS), "step": draw(NUMBERS), "epoch": 0}
    for name in draw(st.lists(st.sampled_from(["reward", "tokens", "kl", "rank", "world_size"]), max_size=3)):
        body[name] = draw(st.one_of(NUMBERS, TEXT, st.none()))
    if draw(st.booleans()):
        body["metrics"] = {draw(TEXT): draw(NUMBERS)}
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))  # NaN/Infinity literals included
    raw = text.encode("utf-8", "surrogatepass")
    return draw(st.sampled_from([raw, b"\xef\xbb\xbf" + raw, raw[: len(raw) // 2], raw + b"x", raw.replace(b":", b": ")]))


@settings(max_examples=400, deadline=None)
@given(step_json())
def test_orjson_and_json_give_the_same_record_or_the_same_error(raw: bytes) -> None:
    fast = outcome(raw)
    saved, events.orjson = events.orjson, None
    try:
        slow = outcome(raw)
    finally:
        events.orjson = saved
    assert fast == slow


@settings(max_examples=400, deadline=None)
@given(st.lists(st.one_of(st.binary(max_size=8), st.integers(0, 10**25).map(lambda n: str(n).encode()),
                          st.sampled_from([b"9" * 18, b"1" * 19, "٣".encode() * 20, b"0" * 19, b"-"])),
                max_size=12).map(b"".join))
def test_the_long_number_guard_finds_exactly_the_runs_of_19_or_more_digits(raw: bytes) -> None:
    import re

    assert events.has_long_number(raw) == (re.search(rb"[0-9]{19,}", raw) is not None)
