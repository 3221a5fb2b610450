"""The fast accept of each field (`_Check.passes`) never accepts what the full check refuses.

`passes` is a shortcut in front of `check_value`, which alone words the errors: for every
field of every event type and values of every shape a reader can meet, a value that
`passes` accepts must be one `check_value` accepts unchanged (None only where optional).
"""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import EVENT_TYPES, StepEvent
from areal_metrics.producers.contract.field_rules import ValidationError, check_value, field_checks, record_accept

CHECKS = [(cls.__name__, c) for cls in EVENT_TYPES.values() for c in field_checks(cls)]

values = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-(2**70), max_value=2**70), st.sampled_from([2**63, 2**64, -(2**63) - 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1.0, 1e308, -1e-308]),
    st.text(max_size=300), st.sampled_from(["", "ok", "full", "quick", "running", "a b", "r" * 129, "warning"]),
    st.lists(st.integers(0, 2), max_size=3), st.tuples(), st.tuples(st.integers(0, 1)), st.tuples(st.text(max_size=3)),
    st.dictionaries(st.text(max_size=3), st.floats(), max_size=2),
    st.just(types.MappingProxyType({})), st.just(types.MappingProxyType({"a": 1.0})),
)


@pytest.mark.parametrize("where,check", CHECKS, ids=[f"{w}.{c.name}" for w, c in CHECKS])
@settings(max_examples=150, deadline=None)
@given(v=values)
def test_a_value_the_fast_accept_takes_passes_the_full_check(where: str, check, v) -> None:
    if not check.passes(v):
        return
    if v is None:
        assert check.optional
        return
    try:
        check_value(f"{where}.{check.name}", check, v)
    except ValidationError as err:
        pytest.fail(f"fast accept took {v!r}, the full check says {err}")


def test_the_fast_accept_takes_the_common_shapes() -> None:
    """Not only refusals: ordinary values skip the full check (else it buys nothing)."""
    by_name = {(w, c.name): c for w, c in CHECKS}
    assert by_name[("StepEvent", "step")].passes(12)
    assert by_name[("StepEvent", "reward")].passes(0.5) and by_name[("StepEvent", "reward")].passes(None)
    assert by_name[("StepEvent", "run_id")].passes("run-1")
    assert not by_name[("StepEvent", "run_id")].passes("run 1")  # the pattern
    assert not by_name[("StepEvent", "clip_ratio")].passes(1.5)  # le=1
    assert not by_name[("StepEvent", "reward")].passes(float("nan"))
    assert not by_name[("StepEvent", "step")].passes(True)  # bool is not an int here


RECORDS = list(EVENT_TYPES.values())
# Values some field accepts, so that most records drawn pass all but a few fields.
ORDINARY = [None, 0, 1, 7, 0.0, 0.5, 1.0, 1234.5, True, "run-1", "n0", "a" * 32, "ok", "full", "quick", "running",
            "warning", "critical", "evaluate_now", "steps", (), types.MappingProxyType({}),
            types.MappingProxyType({"a": 1.0})]


@pytest.mark.parametrize("cls", RECORDS, ids=[c.__name__ for c in RECORDS])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_a_records_one_call_accept_is_every_fields_accept(cls, data) -> None:
    """`record_accept` (its expression is the one the records' generated __init__ and reader
    evaluate) says yes exactly when each field's `passes` does: each field is drawn from the
    shapes above or from a value that field accepts."""
    checks = field_checks(cls)
    row = []
    for c in checks:
        accepted = [v for v in ORDINARY if c.passes(v)]
        if accepted and data.draw(st.booleans(), label=f"{c.name} ordinary"):
            row.append(data.draw(st.sampled_from(accepted), label=c.name))
        else:
            row.append(data.draw(values, label=c.name))
    assert record_accept(cls)(*row) == all(c.passes(v) for c, v in zip(checks, row))


def test_a_record_from_json_lists_and_maps_is_frozen_and_checked_once() -> None:
    """Parsed JSON hands lists and dicts: the record keeps their immutable forms, and a bad
    value inside them is still refused with the field named."""
    ev = StepEvent(run_id="r", step=1, epoch=0, metrics={"a": 1.0}, non_finite=["loss"])  # type: ignore[arg-type]
    assert type(ev.metrics) is types.MappingProxyType and ev.non_finite == ("loss",)
    with pytest.raises(ValidationError, match=r"steps\.metrics\.a: not finite"):
        StepEvent(run_id="r", step=1, epoch=0, metrics={"a": float("nan")})
    with pytest.raises(ValidationError, match=r"steps\.non_finite\[0\]: not a string"):
        StepEvent(run_id="r", step=1, epoch=0, non_finite=[3])  # type: ignore[list-item]
