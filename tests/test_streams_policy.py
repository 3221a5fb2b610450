"""Trigger policy transitions, alert rules and cooldowns, config overrides, the run processor."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from areal_metrics.streams.state import codec
from areal_metrics.producers.contract.events import EvalEvent, StepEvent, parse_event
from areal_metrics.producers.contract.deadletter import rejected
from areal_metrics.streams.core.alerts import (
    BreachState,
    InvalidState,
    StallState,
    ThroughputState,
    breach_step,
    check_invalid,
    check_reward,
    check_stalled,
    check_throughput,
    saw_step,
)
from areal_metrics.producers.contract.config_fields import knobs
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.streams.core.config import (ENV_DEFAULTS, EVAL_LOOP_KEYS, ConfigError, RunConfig, StreamsConfig,
                                               eval_loop_overrides, markdown_table)
from areal_metrics.streams.core.processor import RunState, derived_id, on_eval, on_rejected, on_step, on_tick
from areal_metrics.streams.core.smoothing import SmoothedPoint
from areal_metrics.streams.core.triggers import TriggerState, decide, next_mode

CFG = RunConfig(adaptive_interval=True, window=5, eval_interval=40, min_eval_interval=10, max_eval_interval=160, interval_dwell_steps=10,
                evaluate_delta=0.1)


def pt(step: int, avg: float, slope: float, window: int = 5) -> SmoothedPoint:
    return SmoothedPoint(step, avg, window, avg, avg, slope)


# ------------------------------------------------------------------ triggers


@pytest.mark.parametrize(
    "mode,slope,expected",
    [
        ("normal", 0.02, "fast"), ("normal", 0.0099, "normal"), ("normal", 0.0005, "plateau"),
        ("fast", 0.007, "fast"), ("fast", 0.004, "normal"), ("fast", 0.0001, "plateau"),
        ("plateau", 0.0015, "plateau"), ("plateau", 0.003, "normal"), ("plateau", 0.05, "fast"),
        ("normal", -0.02, "fast"),
    ],
)
def test_mode_transitions_have_hysteresis(mode, slope, expected) -> None:
    assert next_mode(mode, abs(slope), RunConfig()) == expected


def test_interval_shortens_while_fast_bounded_then_lengthens_on_plateau() -> None:
    state = TriggerState()
    seen = []
    # fast climb: slope 0.02 for 40 steps (the avg moves too, so disable evaluate_now here)
    cfg = RunConfig(adaptive_interval=True, window=5, eval_interval=40, min_eval_interval=10, max_eval_interval=160,
                    interval_dwell_steps=10, evaluate_delta=100.0)
    for step in range(5, 45):
        state, ds = decide(state, pt(step, 0.0, 0.02), cfg)
        seen += [(d.step, d.args["steps"]) for d in ds]
    assert seen == [(5, 20), (15, 10)]  # halve at once, again after the dwell, never below 10
    seen = []
    for step in range(45, 100):
        state, ds = decide(state, pt(step, 0.0, 0.0), cfg)
        seen += [(d.step, d.args["steps"]) for d in ds]
    assert seen == [(45, 20), (55, 40), (65, 80), (75, 160)]  # doubling on the plateau, capped at 160
    state, ds = decide(state, pt(100, 0.0, 0.0015), cfg)  # inside the plateau band: no change
    assert ds == []
    state, ds = decide(state, pt(101, 0.0, 0.003), cfg)  # leaves the plateau: back to normal
    assert [(d.command, d.args) for d in ds] == [("set_eval_interval", {"steps": 40})]
    assert "back to normal" in ds[0].reason and "160 -> 40" in ds[0].reason


def test_slope_hovering_at_the_threshold_does_not_flap() -> None:
    state = TriggerState()
    changes = 0
    for step in range(5, 200):
        slope = 0.0101 if step % 2 else 0.0095  # around fast_slope, above fast_exit_slope
        state, ds = decide(state, pt(step, 0.0, slope), RunConfig(adaptive_interval=True, window=5, evaluate_delta=100.0))
        changes += len(ds)
    assert state.mode == "fast"
    assert changes <= 3  # 50 -> 25 -> 12 -> 10, then nothing


def test_evaluate_now_when_reward_moved_since_last_evaluation() -> None:
    state = TriggerState()
    cmds = []
    for step, avg in enumerate([0.1, 0.15, 0.2, 0.21, 0.32, 0.33, 0.2]):
        state, ds = decide(state, pt(step + 5, avg, 0.005), CFG)
        cmds += [(d.step, d.command) for d in ds if d.command == "evaluate_now"]
    assert cmds == [(8, "evaluate_now"), (9, "evaluate_now"), (11, "evaluate_now")]  # 0.1 exactly is not "more"
    assert state.baseline == 0.2 and state.baseline_step == 11


def test_nothing_decided_before_the_window_is_full() -> None:
    state, ds = decide(TriggerState(), pt(1, 5.0, 1.0, window=2), CFG)
    assert ds == [] and state == TriggerState()


# ------------------------------------------------------------------ alerts


def test_breach_fires_once_per_breach_with_cooldown() -> None:
    s = BreachState()
    fired = []
    # breach at 10, recover at 12, breach again at 15 (within cooldown 20), recover, breach at 40
    pattern = {10: True, 11: True, 12: False, 15: True, 16: False, 40: True, 41: True}
    for step in range(0, 45):
        low = pattern.get(step, step in (41,))
        s, f = breach_step(s, low, not low, step, 20)
        if f:
            fired.append(step)
    assert fired == [10, 40]


def test_reward_below_threshold_alerts_once_per_breach() -> None:
    """An alert only: scale_lr comes from evaluation (areal_metrics.streams.core.eval_loop), not from reward."""
    cfg = RunConfig(window=5, reward_threshold=0.3, reward_cooldown_steps=100, lr_factor=0.25)
    s = BreachState()
    s, alerts = check_reward(s, pt(10, 0.35, 0.0), cfg)
    assert alerts == []
    s, alerts = check_reward(s, pt(11, 0.29, 0.0), cfg)
    assert [a.kind for a in alerts] == ["reward_below_threshold"] and alerts[0].threshold == 0.3
    assert "scale" not in alerts[0].message
    s, alerts = check_reward(s, pt(12, 0.2, 0.0), cfg)
    assert alerts == []
    s, alerts = check_reward(s, pt(11, 0.29, 0.0, window=3), cfg)  # window not full: ignored
    assert alerts == []
    assert check_reward(BreachState(), pt(11, -5.0, 0.0), RunConfig(window=5))[1] == []  # threshold off


def test_throughput_drop_against_trailing_median() -> None:
    cfg = RunConfig(throughput_window=10, throughput_min_samples=5, throughput_drop_ratio=0.5,
                    throughput_cooldown_steps=0)
    s = ThroughputState()
    fired = []
    values = [100, 110, 90, 105, 95, 40, 42, 100, 100, 30]
    for step, v in enumerate(values):
        s, alerts = check_throughput(s, step, float(v), cfg)
        fired += [(a.step, a.value) for a in alerts]
    assert fired == [(5, 40.0), (9, 30.0)]
    assert len(s.history) == 10


def test_stalled_once_per_silence_with_injected_clock() -> None:
    cfg = RunConfig(stall_seconds=60)
    s = saw_step(StallState(), 7, now=1000.0)
    s, alerts = check_stalled(s, 1059.0, cfg)
    assert alerts == []
    s, alerts = check_stalled(s, 1060.0, cfg)
    assert [a.kind for a in alerts] == ["stalled"] and alerts[0].step == 7
    s, alerts = check_stalled(s, 2000.0, cfg)
    assert alerts == []
    s = saw_step(s, 8, now=2001.0)
    s, alerts = check_stalled(s, 2062.0, cfg)
    assert len(alerts) == 1 and alerts[0].about != "stalled|7|1000.0"
    assert check_stalled(saw_step(StallState(), 1, 0.0), 1e9, RunConfig(stall_seconds=0))[1] == []


def test_invalid_event_alerts_are_rate_limited() -> None:
    cfg = RunConfig(invalid_alert_interval_s=60)
    s = InvalidState()
    kinds = []
    for now in (0.0, 1.0, 2.0, 59.0, 61.0):
        s, alerts = check_invalid(s, "steps.reward: missing", "areal.steps", f"m{now}", now, cfg)
        kinds += [(now, a.message) for a in alerts]
    assert [k[0] for k in kinds] == [0.0, 61.0]
    assert "(+3 more since the last alert)" in kinds[1][1]


# ------------------------------------------------------------------ config


def test_config_overrides_per_run_and_patterns(tmp_path) -> None:
    path = tmp_path / "streams.json"
    path.write_text(json.dumps({"defaults": {"window": 10, "reward_threshold": 0.2},
                                "runs": {"ppo-*": {"reward_threshold": 0.3}, "ppo-a": {"window": 4}}}))
    cfg = StreamsConfig.load(path)
    assert cfg.for_run("other").window == 10 and cfg.for_run("other").reward_threshold == 0.2
    assert cfg.for_run("ppo-b").reward_threshold == 0.3 and cfg.for_run("ppo-b").window == 10
    assert cfg.for_run("ppo-a").reward_threshold == 0.3 and cfg.for_run("ppo-a").window == 4
    assert StreamsConfig.load(None).for_run("x") == RunConfig()


@pytest.mark.parametrize(
    "data,message",
    [
        ({"defaults": {"windw": 3}}, "streams config defaults: unknown key 'windw'"),
        ({"runs": {"r": {"window": 0}}}, "window: must be >= 1"),
        ({"defaults": {"fast_exit_slope": 1.0}}, "fast_exit_slope"),
        ({"defaults": {"window": "ten"}}, "window: Expected `int`, got `str`"),
        ({"defaults": {"window": 2.5}}, "window: Expected `int`, got `float`"),
        ({"defaults": {"lr_eval_threshold": None, "reward_threshold": True}}, "reward_threshold: Expected `float | null`, got `bool`"),
        ({"extra": 1}, "unknown key 'extra'"),
    ],
)
def test_config_errors_name_the_field(data, message) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        StreamsConfig.from_dict(data)


def test_config_values_take_their_fields_types() -> None:
    """JSON has one number type and TOML is written by hand: a whole float where an integer
    is meant, an integer where a float is; a non-finite number is refused by name."""
    cfg = StreamsConfig.from_dict({"defaults": {"window": 30.0, "ema_alpha": 1, "reward_threshold": 0}}).for_run("r")
    assert (cfg.window, cfg.ema_alpha, cfg.reward_threshold) == (30, 1.0, 0.0)
    assert type(cfg.window) is int and type(cfg.ema_alpha) is float and type(cfg.reward_threshold) is float
    with pytest.raises(ConfigError, match="stall_seconds: not finite"):
        StreamsConfig.from_dict({"defaults": {"stall_seconds": float("inf")}})


def test_every_path_that_makes_a_run_config_checks_it_with_the_same_words() -> None:
    """Code, the config file and a run's eval_loop go through one declaration (type, Meta range):
    the same refusal, naming the knob, whichever path the value came by."""
    words = "lr_alpha: must be in (0, 0.5] (got 0.9)"
    with pytest.raises(ConfigError, match=re.escape(words)):
        RunConfig(lr_alpha=0.9)
    with pytest.raises(ConfigError, match=re.escape(f"streams config defaults: {words}")):
        StreamsConfig.from_dict({"defaults": {"lr_alpha": 0.9}})
    assert eval_loop_overrides({"alpha": 0.9}, RunConfig()) == ({}, ["run.config.eval_loop.alpha: must be in (0, 0.5] (got 0.9)"])
    for kwargs, message in [(dict(window=0), "window: must be >= 1 (got 0)"),
                            (dict(lr_eval_stage="fast"), "lr_eval_stage: must be quick or full (got 'fast')"),
                            (dict(lr_eval_dataset=""), "lr_eval_dataset: must be 1..128 characters (got '')"),
                            (dict(window=True), "window: Expected `int`, got `bool`"),
                            (dict(fast_slope=float("nan")), "fast_slope: not finite"),
                            (dict(max_pending_steps=10**30), "max_pending_steps: too large"),
                            (dict(min_eval_interval=30), "eval_interval: need 1 <= min_eval_interval")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            RunConfig(**kwargs)
        with pytest.raises(ConfigError, match=re.escape(message)):
            RunConfig().with_overrides(kwargs)
    with pytest.raises(ConfigError, match=re.escape("streams config: tick_interval_s: must be in (0, 3600] (got 0)")):
        StreamsConfig.from_dict({"tick_interval_s": 0})
    with pytest.raises(ConfigError, match=re.escape("streams config: runs: Expected `object`, got `array`")):
        StreamsConfig.from_dict({"runs": []})


def test_each_knob_is_declared_once_with_its_text() -> None:
    """Every knob carries its description on its field; the eval_loop keys and the knobs a
    variable sets are read off the same declarations."""
    assert all(k.description for k in knobs(RunConfig))
    assert EVAL_LOOP_KEYS["alpha"] == "lr_alpha" and EVAL_LOOP_KEYS["patience_rounds"] == "no_improvement_rounds"
    assert len(EVAL_LOOP_KEYS) == 12 and set(ENV_DEFAULTS) == {"command_ack_steps", "vote_undecided_alert"}
    variables = {f.name: f.metadata["env"] for f in dataclasses.fields(Settings)}
    assert all(variables[k.name] == k.extra["env"] for k in knobs(RunConfig) if "env" in k.extra)  # the same variable


def test_the_knob_table_in_streams_md_is_the_one_the_declarations_make() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "STREAMS.md").read_text()
    assert markdown_table() in page, "run `python -m areal_metrics.streams.core.config` into docs/STREAMS.md"
    assert "| `lr_alpha` | 0.05 | in (0, 0.5] | " in markdown_table()  # the range comes from the field's Meta


# ------------------------------------------------------------------ processor


def step_ev(step: int, reward: float | None, **kw) -> StepEvent:
    return StepEvent(run_id="run-a", node="n0", step=step, epoch=0, reward=reward, ts=1000.0 + step,
                     event_id=kw.pop("event_id", f"s{step}"), **kw)


def test_processor_step_outputs_and_state_round_trip() -> None:
    cfg = RunConfig(window=3, reward_threshold=0.5, evaluate_delta=10.0)
    state = RunState("run-a")
    all_out = []
    for step, r in enumerate([0.9, 0.8, 0.7, 0.3, 0.2, 0.1]):
        state, out = on_step(state, step_ev(step, r), now=float(step), cfg=cfg)
        all_out += out
        state = codec.loads(RunState, codec.dumps(state))
    types = [(o.event.type, getattr(o.event, "command", getattr(o.event, "kind", None))) for o in all_out]
    assert types.count(("reward_smoothed", None)) == 6
    assert ("alert", "reward_below_threshold") in types and ("command", "scale_lr") not in types
    smoothed = [o.event for o in all_out if o.event.type == "reward_smoothed"]
    assert smoothed[2].event_id == derived_id("reward_smoothed", "run-a", 2)
    assert all(not o.must_ack for o in all_out if o.event.type == "reward_smoothed")
    assert all(o.must_ack for o in all_out if o.event.type != "reward_smoothed")
    # every output is a valid contract record on the wire
    for o in all_out:
        assert parse_event(o.event.to_json()).to_dict() == o.event.to_dict()


def test_processor_redelivered_step_resends_the_same_point_other_rank_adds_nothing() -> None:
    cfg = RunConfig(window=3)
    state, first = on_step(RunState("run-a"), step_ev(0, 0.5), 0.0, cfg)
    state, _ = on_step(state, step_ev(1, 0.7), 1.0, cfg)
    same_state, again = on_step(state, step_ev(0, 0.5), 2.0, cfg)
    assert [o.event.to_dict() for o in again] == [first[0].event.to_dict()]
    _, other = on_step(state, step_ev(0, 0.1, event_id="other-rank"), 2.0, cfg)
    assert other == []
    assert same_state.smoothing == state.smoothing


def test_processor_eval_round_and_tick() -> None:
    cfg = RunConfig(vote_timeout_s=10)
    state = RunState("run-a")
    for node in ("a", "b"):
        ev = EvalEvent(run_id="run-a", node=node, eval_id="e1", step=5, dataset="d", stage="quick", accuracy=0.5,
                       verdicts=(1, 0), replicas=3, ts=50.0, event_id=f"ev-{node}")
        state, out = on_eval(state, ev, now=1.0, cfg=cfg)
    assert [o.event.type for o in out] == ["eval_consensus"]
    c = out[0].event
    assert c.event_id == derived_id("eval_consensus", "run-a", "e1", "d", "quick") and c.votes == 2
    ev = EvalEvent(run_id="run-a", node="a", eval_id="e2", step=9, dataset="d", stage="quick", accuracy=0.5,
                   replicas=3, ts=60.0, event_id="x")
    state, out = on_eval(state, ev, now=2.0, cfg=cfg)
    assert out == []
    state, out = on_tick(state, now=12.5, cfg=cfg)
    assert [(o.event.type, getattr(o.event, "stale", None)) for o in out] == [("eval_consensus", True), ("alert", None)]
    assert out[0].event.eval_id == "e2" and out[0].event.accuracy == 0.5


def test_processor_rejected_dead_letter_and_rate_limited_alert() -> None:
    cfg = RunConfig(invalid_alert_interval_s=60)
    state = RunState("run-a")
    bad = rejected(b'{"type":"step","run_id":"run-a"}', "steps.step: missing", "areal.steps", node="areal-streams")
    state, out1 = on_rejected(state, bad, "areal.steps/0/17", now=0.0, cfg=cfg)
    state, out2 = on_rejected(state, bad, "areal.steps/0/18", now=1.0, cfg=cfg)
    assert [o.event.type for o in out1] == ["rejected", "alert"]
    assert [o.event.type for o in out2] == ["rejected"]
    assert out1[0].event.event_id == derived_id("rejected", "areal.steps/0/17")
    assert "steps.step: missing" in out1[1].event.message


def test_reward_rule_arms_only_once_the_reward_was_above_the_threshold() -> None:
    cfg = RunConfig(window=5, reward_threshold=0.3, reward_cooldown_steps=0)
    s = RunState("r").reward_alert
    fired = []
    for step, avg in enumerate([0.1, 0.2, 0.25, 0.31, 0.35, 0.29, 0.28, 0.4, 0.1]):
        s, alerts = check_reward(s, pt(step, avg, 0.0), cfg)
        fired += [a.step for a in alerts]
    assert fired == [5, 8]  # not at the start, where the run was still climbing


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-0.05, max_value=0.05), min_size=1, max_size=300), st.integers(1, 60))
def test_a_noisy_slope_never_changes_the_interval_twice_within_the_dwell(slopes, dwell):
    cfg = RunConfig(adaptive_interval=True, window=5, interval_dwell_steps=dwell)
    state, changes = TriggerState(), []
    for step, slope in enumerate(slopes, start=5):
        state, decisions = decide(state, SmoothedPoint(step, 0.5, 5, 0.5, 0.5, slope), cfg)
        changes += [d.step for d in decisions if d.command == "set_eval_interval"]
        assert cfg.min_eval_interval <= (state.interval or cfg.eval_interval) <= cfg.max_eval_interval
    assert all(b - a >= dwell for a, b in zip(changes, changes[1:]))


@given(st.lists(st.one_of(st.text(), st.integers(), st.sampled_from(["a|b", "\\", "|", "c\\|d"])), max_size=6))
def test_derived_ids_are_the_uuid5_earlier_versions_gave(parts: list[object]) -> None:
    """derived_id skips building UUID objects; its ids must stay those of uuid.uuid5, or a
    batch redelivered across an upgrade would give its outputs new ids (and duplicates)."""
    import uuid

    from areal_metrics.streams.core.processor import _ID_NAMESPACE, _id_part

    expected = uuid.uuid5(_ID_NAMESPACE, "|".join(_id_part(p) for p in parts)).hex
    assert derived_id(*parts) == expected



def test_an_evaluate_now_never_names_an_evaluation_that_did_not_happen() -> None:
    """Issue 40, item 13: a plain loop that evaluates at steps 0, 10, 20, 30 while its reward climbs was
    told "since the last evaluation at step 19" (the worker's own request). The baseline is the worker's
    (decisions replay from the step stream alone), so the reason says so: its last evaluate_now, or the
    first full window."""
    from areal_metrics.streams.core.processor import RunState as Run

    cfg = RunConfig(window=5, evaluate_delta=0.05)
    state, commands = Run("plain"), []
    for step in range(40):
        if step % 10 == 0:
            ev = EvalEvent(run_id="plain", node="n0", eval_id=f"e{step}", step=step, dataset="d", accuracy=0.5,
                           verdicts=(1, 0), ts=float(step), event_id=f"e{step}")
            state, _ = on_eval(state, ev, float(step), cfg)
        ev = StepEvent(run_id="plain", step=step, epoch=0, reward=0.01 * step, ts=float(step), event_id=f"s{step}")
        state, out = on_step(state, ev, float(step), cfg)
        commands += [(step, o.event) for o in out if o.event.type == "command" and o.event.command == "evaluate_now"]
    assert len(commands) >= 3, "the climb should ask for evaluations"
    assert not any("last evaluation" in c.reason for _, c in commands), [c.reason for _, c in commands]
    assert "since step 4 (the first full window)" in commands[0][1].reason
    for (sent, _), (_, c) in zip(commands, commands[1:]):  # each names the request before it, at its true step
        assert f"since the evaluate_now sent at step {sent} " in c.reason, c.reason


def test_before_any_request_the_reason_names_the_first_full_window() -> None:
    state, ds = TriggerState(), []
    for step, avg in enumerate([0.1, 0.1, 0.3]):
        state, more = decide(state, pt(step + 5, avg, 0.0), CFG)
        ds += more
    [d] = ds
    assert "since step 5 (the first full window)" in d.reason
    state, [d] = decide(state, pt(9, 0.5, 0.0), CFG)
    assert "since the evaluate_now sent at step 7 " in d.reason
