"""areal_metrics.streams.core.stored: the worker's state classes are frozen msgspec Structs,
changed with msgspec.structs.replace, and their mappings are read-only Pairs."""

from __future__ import annotations

import typing

import msgspec
import pytest
from msgspec.structs import replace

from areal_metrics.streams.core.processor import RunState
from areal_metrics.streams.core.ranks import PendingStep, RankReport, RankState
from areal_metrics.streams.core.smoothing import SmoothedPoint, SmoothingState
from areal_metrics.streams.core.stored import Pairs, Stored
from areal_metrics.streams.core.voting import NodeResult, VoteState
from areal_metrics.streams.state import codec


def test_replace_makes_a_changed_copy_and_leaves_the_original() -> None:
    point = SmoothedPoint(3, 0.5, 2, 0.4, 0.45, 0.01, "e1", 1)
    state = SmoothingState(points=(point,), ema_base=0.3, max_step=3)
    new = replace(state, points=(), ema_base=None, attempt=2)
    assert (new.points, new.ema_base, new.attempt, new.max_step) == ((), None, 2, 3)
    assert state == SmoothingState(points=(point,), ema_base=0.3, max_step=3)  # untouched
    assert replace(state) == state and hash(replace(state)) == hash(state)
    with pytest.raises(AttributeError):
        new.max_step = 2  # type: ignore[misc]
    with pytest.raises(TypeError, match="nope"):
        replace(state, nope=1)
    run = RunState("r")
    assert replace(run, smoothing=state).smoothing is state and replace(run, smoothing=state).run_id == "r"


def test_a_mapping_given_to_a_state_is_held_read_only() -> None:
    pending = {(0, 1): PendingStep(2, 0.0, 0.0, (RankReport(0, 0.5, None),))}
    ranks = RankState(pending)
    assert type(ranks.pending) is Pairs and ranks.pending == pending
    with pytest.raises(TypeError):
        ranks.pending[(0, 2)] = ranks.pending[(0, 1)]  # type: ignore[index]
    # replace and the default give a Pairs too; a Pairs is kept as it is
    assert type(replace(RunState("r"), invalid={}).invalid) is Pairs and type(VoteState().open_rounds) is Pairs
    assert RankState(ranks.pending).pending is ranks.pending
    result = NodeResult("n", True, metrics={"pass@1": 0.5})
    assert codec.dumps(result).endswith(b'"metrics":[["pass@1",0.5]]}')  # pairs on the wire, not an object


def state_classes(tp: object, found: set[type]) -> set[type]:
    """The Struct classes a value of type `tp` may hold, at any depth (fields, unions, tuples, Pairs)."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        if tp in found:
            return found
        found.add(tp)
        for f in msgspec.structs.fields(tp):
            state_classes(f.type, found)
    for arg in typing.get_args(tp):
        state_classes(arg, found)
    return found


def test_every_class_in_a_run_state_is_a_frozen_stored_struct() -> None:
    # (the core's other values, such as a step ready to be smoothed, may be Structs too: not stored)
    found = state_classes(RunState, set())
    assert len(found) >= 15, found
    assert {SmoothedPoint, PendingStep, NodeResult} <= found
    for cls in found:
        assert issubclass(cls, Stored) and cls.__struct_config__.frozen, cls
