"""parse_event reads bytes with msgspec, and what msgspec refuses as JSON (NaN, a lone
surrogate escape, a BOM) through `json` and msgspec.convert: the two paths must accept the
same records and refuse the same ones, naming the same field."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import StepEvent, ValidationError, event_from_dict, parse_event

NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**19, -(10**19), 1e308, 5e-324, 0.1]))
TEXT = st.one_of(st.text(max_size=20), st.sampled_from(["\ud800", "ключ", "\x00", "a\nb", ""]))


def outcome(read: Any) -> Any:
    try:
        return read().to_dict()
    except ValidationError as err:
        return f"error at {err.where}"


@st.composite
def step_json(draw: Any) -> bytes:
    body: dict[str, Any] = {"type": "step", "run_id": draw(st.sampled_from(["r1", "bad id"])), "event_id": "e",
                            "ts": draw(NUMBERS), "step": draw(NUMBERS), "epoch": 0}
    for name in draw(st.lists(st.sampled_from(["reward", "tokens", "kl", "rank", "world_size", "node"]), max_size=3)):
        body[name] = draw(st.one_of(NUMBERS, TEXT, st.none()))
    if draw(st.booleans()):
        body["metrics"] = {draw(TEXT): draw(NUMBERS)}
    text = json.dumps(body, ensure_ascii=draw(st.booleans()))  # NaN/Infinity literals included
    return text.encode("utf-8", "surrogatepass")


@settings(max_examples=400, deadline=None)
@given(step_json())
def test_bytes_and_a_decoded_object_give_the_same_record_or_an_error_at_the_same_field(raw: bytes) -> None:
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:  # surrogatepass bytes (which json.loads(bytes) would take): not UTF-8
        assert outcome(lambda: parse_event(raw)) == "error at event"
        return
    assert outcome(lambda: parse_event(raw, expected=StepEvent)) == outcome(lambda: event_from_dict(data, StepEvent))
