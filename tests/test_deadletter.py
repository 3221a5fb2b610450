"""The dead-letter builder never raises, whatever the key or run id of the bad input."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.deadletter import UNKNOWN_RUN, guess_run_id, rejected
from areal_metrics.producers.contract.ids import is_valid_run_id


def test_unicode_key_is_not_taken_for_a_run_id() -> None:
    # The crash of the landed code: `isalnum()` accepted these, RejectedEvent refused them.
    for key in ("ключ", "café", "ß", "٣"):
        assert guess_run_id(b"{not json", key.encode()) == UNKNOWN_RUN
        assert rejected(b"{not json", "bad", "areal.evals", node="n", key=key.encode()).run_id == UNKNOWN_RUN


def test_valid_key_keeps_the_dead_letter_with_its_run() -> None:
    assert rejected(b"{}", "bad", "areal.steps", node="n", key=b"run-1").run_id == "run-1"


@settings(max_examples=300, deadline=None)
@given(key=st.one_of(st.none(), st.binary(max_size=300), st.text(max_size=300).map(str.encode)),
       run_id=st.one_of(st.text(max_size=200), st.integers(), st.none()),
       raw_is_json=st.booleans())
def test_rejected_never_raises(key: bytes | None, run_id: object, raw_is_json: bool) -> None:
    raw = json.dumps({"run_id": run_id}).encode() if raw_is_json else b"\xff\xfe" + (key or b"")
    event = rejected(raw, "some.field: bad", "areal.steps", node="n", key=key)
    assert is_valid_run_id(event.run_id)
