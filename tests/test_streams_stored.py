"""areal_metrics.streams.core.evolve: dataclasses.replace for the stored state, as a __dict__ copy."""

from __future__ import annotations

import dataclasses

import pytest

from areal_metrics.streams.core.evolve import evolve
from areal_metrics.streams.core.processor import RunState
from areal_metrics.streams.core.ranks import RankReport, StepReward
from areal_metrics.streams.core.smoothing import SmoothedPoint, SmoothingState


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


def _stored_state_classes() -> list[type]:
    """Every class declared with @stored in the worker's state modules."""
    import importlib

    found = []
    for name in ("alerts", "eval_loop", "lifecycle", "processor", "ranks", "smoothing", "triggers", "voting"):
        module = importlib.import_module(f"areal_metrics.streams.core.{name}")
        found += [c for c in vars(module).values()
                  if isinstance(c, type) and c.__module__ == module.__name__ and c.__dict__.get("_stored")]
    assert len(found) >= 15, found
    return found


def test_stored_builds_what_a_frozen_dataclass_builds() -> None:
    import inspect

    from areal_metrics.streams.core.evolve import stored

    def body() -> dict:
        return {"__annotations__": {"a": "int", "b": "float", "c": "tuple", "d": "object"}, "b": 1.5, "c": (),
                "d": dataclasses.field(default_factory=object)}

    fast = stored(type("S", (), body()))
    plain = dataclasses.dataclass(frozen=True)(type("S", (), body()))
    def shape(cls: type) -> list:  # (name, kind, default), a factory's default as "factory"
        return [(p.name, p.kind, "factory" if p.name == "d" else p.default)
                for p in inspect.signature(cls).parameters.values()]

    assert shape(fast) == shape(plain)
    for args, kwargs in (((1, 2.0), {"d": "x"}), ((), {"a": 3, "c": (1,), "d": 4}), ((1, 2.0, (3,), "y"), {})):
        s, p = fast(*args, **kwargs), plain(*args, **kwargs)
        assert s.__dict__ == p.__dict__ and list(s.__dict__) == list(p.__dict__)  # fields in order (orjson)
        assert s == fast(*args, **kwargs) and hash(s) == hash(fast(*args, **kwargs)) and repr(s) == repr(p)
    assert fast(1).d is not fast(1).d  # each instance runs the factory
    for args, kwargs in (((), {}), ((1, 2, 3, {}, 5), {}), ((1,), {"e": 2}), ((1,), {"a": 2})):
        with pytest.raises(TypeError):
            fast(*args, **kwargs)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast(1).a = 2  # type: ignore[attr-defined]
    for cls in _stored_state_classes():  # the worker's own: the dataclass's signature, field for field
        params = list(inspect.signature(cls).parameters.values())
        assert [p.name for p in params] == [f.name for f in dataclasses.fields(cls)], cls
        for p, f in zip(params, dataclasses.fields(cls)):
            if f.default is not dataclasses.MISSING:
                assert p.default == f.default, (cls, f.name)
