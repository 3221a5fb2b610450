"""`run.config.eval_loop` is declared once (producers/contract/eval_loop.py): the stream worker's
knobs take their types from it, and the worker (a run event's eval_loop) and the reference
trainer (its `eval_loop` setting) accept and refuse the same mappings in the same words."""

from __future__ import annotations

import re
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from areal_metrics.areal_train.config import from_mapping
from areal_metrics.producers.contract.config_fields import knobs, rule
from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.eval_loop import EVAL_LOOP
from areal_metrics.streams.core.config import EVAL_LOOP_KEYS, RunConfig, eval_loop_overrides

KNOBS = {k.name: k for k in knobs(RunConfig)}
HINTS = RunConfig.__annotations__  # (strings: `from __future__ import annotations`), for the test's message only


def test_the_worker_knobs_are_the_contract_keys_with_the_contract_ranges() -> None:
    assert list(EVAL_LOOP) == ["enabled", "dataset", "stage", "threshold", "alpha", "patience_rounds", "factor",
                               "min_factor", "adaptive_interval", "rollback", "horizon_rounds", "raise_after_rounds"]
    assert set(EVAL_LOOP_KEYS) == set(EVAL_LOOP)
    for key, name in EVAL_LOOP_KEYS.items():
        assert KNOBS[name].rule == rule(EVAL_LOOP[key]), (key, HINTS[name])
    assert KNOBS["lr_alpha"].rule == "in (0, 0.5]" and KNOBS["lr_horizon_rounds"].rule == "in [1, 1000000]"


def trainer(loop: dict[str, Any]) -> str | None:
    """The reference trainer's refusal of `loop` as its eval_loop setting, without its prefix (None: taken)."""
    try:
        cfg = from_mapping({"eval_loop": loop})
    except ConfigError as exc:
        text = str(exc)
        assert text.startswith("config: eval_loop."), text
        return text.removeprefix("config: eval_loop.")
    assert cfg.to_dict()["eval_loop"] == loop  # passed on to the run event as given
    return None


values = st.one_of(st.none(), st.booleans(), st.integers(min_value=-5, max_value=2_000_000),
                   st.integers(min_value=2**62, max_value=2**70), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, 0.5, 1.0, 0.01, 0.009, 3.0, 1e6, 1e6 + 1, 0.05, 0.5000001]),
                   st.text(max_size=3), st.sampled_from(["quick", "full", "", "x" * 129, "gsm8k"]),
                   st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=1))
keys = st.one_of(st.sampled_from(list(EVAL_LOOP)), st.text(max_size=70))
loops = st.dictionaries(keys, values, max_size=4)


@settings(max_examples=400, deadline=None)
@given(loops)
@example({"horizon_rounds": 50, "raise_after_rounds": 0})
@example({"alpha": 0.9})
@example({"enabled": "yes"})
@example({"thresh": 0.1})
@example({"threshold": float("nan")})
@example({"patience_rounds": 10**30})
@example({"horizon_rounds": 3.0, "dataset": None, "threshold": None})
def test_the_trainer_and_the_worker_accept_and_refuse_the_same_eval_loops(loop: dict[str, Any]) -> None:
    overrides, errors = eval_loop_overrides(loop)
    refused = trainer(loop)
    assert (refused is None) == (errors == [])
    if refused is not None:  # the trainer names the first key the worker refused, in the worker's words
        assert errors[0] == f"run.config.eval_loop.{refused}"[:300]
    # The worker's knobs take exactly what the contract took, and refuse the rest in the same words.
    RunConfig().with_overrides(overrides)
    assert len(overrides) + len(errors) == len(loop)
    for key, value in loop.items():
        if key in EVAL_LOOP and EVAL_LOOP_KEYS[key] not in overrides:
            name = EVAL_LOOP_KEYS[key]
            with pytest.raises(ConfigError) as exc:
                RunConfig().with_overrides({name: value})
            words = str(exc.value).removeprefix(f"streams config: {name}: ")
            assert f"run.config.eval_loop.{key}: {words}"[:300] in errors


def test_the_trainer_refuses_a_bad_value_with_the_worker_words() -> None:
    for loop, words in [({"alpha": 0.9}, "eval_loop.alpha: must be in (0, 0.5] (got 0.9)"),
                        ({"stage": "fast"}, "eval_loop.stage: must be quick or full (got 'fast')"),
                        ({"enabled": "yes"}, "eval_loop.enabled: Expected `bool`, got `str` ('yes')"),
                        ({"horizon_rounds": 0}, "eval_loop.horizon_rounds: must be in [1, 1000000] (got 0)"),
                        ({"colour": "red"}, "eval_loop.colour: unknown (known: enabled, dataset, stage, ")]:
        with pytest.raises(ConfigError, match=re.escape(f"config: {words}")):
            from_mapping({"eval_loop": loop})
        assert eval_loop_overrides(loop)[1][0].startswith(f"run.config.{words}")
