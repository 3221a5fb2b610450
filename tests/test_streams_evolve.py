"""streams.evolve: dataclasses.replace for the stored state, as a __dict__ copy."""

from __future__ import annotations

import dataclasses

import pytest

from streams.evolve import evolve
from streams.processor import RunState
from streams.ranks import RankReport, StepReward
from streams.smoothing import SmoothedPoint, SmoothingState


def test_evolve_is_dataclasses_replace_for_the_stored_state() -> None:
    point = SmoothedPoint(3, 0.5, 2, 0.4, 0.45, 0.01, "e1", 1)
    state = SmoothingState(points=(point,), ema_base=0.3, max_step=3)
    for changes in ({}, {"max_step": 9}, {"points": (), "ema_base": None, "attempt": 2}):
        new = evolve(state, **changes)
        assert new == dataclasses.replace(state, **changes) and type(new) is SmoothingState
        assert hash(new) == hash(dataclasses.replace(state, **changes))
    assert state.max_step == 3 and evolve(state, max_step=9) is not state  # the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolve(state, max_step=1).max_step = 2  # type: ignore[misc]
    run = RunState("r")
    assert evolve(run, smoothing=state).smoothing is state and evolve(run, smoothing=state).run_id == "r"


def test_evolve_refuses_an_unknown_field_and_a_class_it_would_get_wrong() -> None:
    with pytest.raises(TypeError, match="has no field 'nope'"):
        evolve(SmoothingState(), nope=1)
    with pytest.raises(TypeError, match="not a stored-state dataclass"):
        evolve(StepReward(0, 1, 0.5, 1, 1, "", 0.0), step=2)  # slotted: no __dict__ to copy
    assert evolve(RankReport(0, 0.5, None), rank=1) == RankReport(1, 0.5, None)
