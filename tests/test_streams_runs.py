"""Run lifecycle (areal.runs), non_finite alerts, and the trigger's published interval and learning gate."""

from __future__ import annotations

import random

from areal_metrics.streams.state import codec
from areal_metrics.producers.contract.events import RunEvent, StepEvent
from areal_metrics.streams.core.alerts import NON_FINITE_FIELDS_KEPT, NonFiniteState, check_non_finite
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.lifecycle import Lifecycle, on_run_event, saw_attempt
from areal_metrics.streams.core.processor import RunState, has_clock_work, on_run, on_step, on_tick
from areal_metrics.streams.core.smoothing import SmoothedPoint
from areal_metrics.streams.core.triggers import TriggerState, decide, published_interval

CFG = RunConfig(window=3, stall_seconds=60)


def run_ev(status: str, rank: int = 0, *, world: int = 2, attempt: int = 0, config: dict | None = None) -> RunEvent:
    return RunEvent(run_id="run-z", node=f"n{rank}", rank=rank, status=status, world_size=world, attempt=attempt,
                    config=config or {}, ts=1000.0, event_id=f"{status}-{rank}-{attempt}")


def step_ev(step: int, *, attempt: int = 0, reward: float | None = 0.5, **kw) -> StepEvent:
    return StepEvent(run_id="run-z", node="n0", step=step, epoch=0, reward=reward, attempt=attempt, ts=1000.0 + step,
                     event_id=f"a{attempt}-s{step}-{kw.get('rank', 0)}", **kw)


def kinds(outputs) -> list[str]:
    return [o.event.kind for o in outputs if o.event.type == "alert"]


# ------------------------------------------------------------------ lifecycle


def test_rank_zero_or_every_rank_ends_the_run_and_a_new_attempt_re_arms_it() -> None:
    s = on_run_event(Lifecycle(), "running", 0, 2, 0)
    s = on_run_event(s, "finished", 1, 2, 0)
    assert not s.ended and s.done_ranks == (1,)
    assert on_run_event(s, "killed", 0, 2, 0).ended  # rank 0 alone ends it
    both = on_run_event(Lifecycle(), "failed", 1, 2, 0)
    both = on_run_event(both, "failed", 1, 2, 0)  # the same rank twice is one rank
    assert not both.ended
    s3 = on_run_event(on_run_event(Lifecycle(), "finished", 2, 3, 0), "finished", 1, 3, 0)
    s4 = on_run_event(s3, "finished", 3, 3, 0)  # rank 3: the world is at least 4, whatever the event says
    assert not s3.ended and not s4.ended and s4.world_size == 4
    ended = on_run_event(Lifecycle(), "finished", 0, 1, 0)
    assert ended.ended and ended.status == "finished" and ended.done_ranks == ()
    assert on_run_event(ended, "running", 0, 1, 0).ended  # a late `running` of the same attempt
    assert on_run_event(ended, "finished", 0, 1, 0) == ended
    resumed = on_run_event(ended, "running", 0, 1, 1)
    assert not resumed.ended and resumed.attempt == 1
    assert on_run_event(resumed, "finished", 0, 1, 0) == resumed  # news of the old attempt
    assert not saw_attempt(ended, 1).ended and saw_attempt(ended, 0) is ended


def test_a_finished_run_is_never_stalled_but_a_resumed_one_is_watched_again() -> None:
    state = RunState("run-z")
    for step in range(3):
        state, _ = on_step(state, step_ev(step), float(step), CFG)
    state, out = on_run(state, run_ev("finished", 0), 3.0, CFG)
    assert out == []
    state, _ = on_step(state, step_ev(3), 4.0, CFG)  # a last step processed after the end (another topic)
    assert not has_clock_work(state, 1e6, CFG)
    state, out = on_tick(state, 1e6, CFG)
    assert kinds(out) == []
    state, _ = on_run(state, run_ev("running", 0, attempt=1), 2e6, CFG)
    state, _ = on_step(state, step_ev(2, attempt=1), 2e6, CFG)
    state, out = on_tick(state, 2e6 + 60, CFG)
    assert kinds(out) == ["stalled"]


def test_a_run_that_ends_failed_or_killed_raises_one_alert_and_a_finished_one_none() -> None:
    for status in ("failed", "killed"):
        state = RunState("run-z")
        state, _ = on_step(state, step_ev(0), 0.0, CFG)
        state, out = on_run(state, run_ev(status, 1), 1.0, CFG)  # rank 1 alone does not end a 2-rank run
        assert kinds(out) == []
        state, out = on_run(state, run_ev(status, 0), 2.0, CFG)
        assert kinds(out) == [f"run_{status}"] and out[0].event.severity == "critical"
        assert status in out[0].event.message
        first_id = out[0].event.event_id
        state, again = on_run(state, run_ev(status, 0), 3.0, CFG)  # redelivered: the run had ended already
        assert kinds(again) == []
        state, out = on_tick(state, 1e6, CFG)
        assert kinds(out) == []  # an ended run is not stalled
        state, _ = on_run(state, run_ev("running", 0, attempt=1), 2e6, CFG)
        state, resumed_end = on_run(state, run_ev(status, 0, attempt=1), 2e6 + 1, CFG)
        assert kinds(resumed_end) == [f"run_{status}"]  # a resumed attempt's own end
        assert resumed_end[0].event.event_id != first_id
    _, finished = on_run(RunState("run-z"), run_ev("finished", 0), 1.0, CFG)
    assert finished == []


def test_a_step_of_a_new_attempt_re_arms_the_watch_without_a_run_event() -> None:
    state, _ = on_step(RunState("run-z"), step_ev(5), 0.0, CFG)
    state, _ = on_run(state, run_ev("finished", 0, world=1), 1.0, CFG)
    state, _ = on_step(state, step_ev(3, attempt=1), 2.0, CFG)
    assert kinds(on_tick(state, 62.0, CFG)[1]) == ["stalled"]


# ------------------------------------------------------------------ non_finite


def test_non_finite_alerts_once_per_run_and_field() -> None:
    state, out = on_step(RunState("run-z"), step_ev(0, reward=None, non_finite=("reward", "kl")), 0.0, CFG)
    [alert] = [o.event for o in out if o.event.type == "alert"]
    assert alert.kind == "non_finite" and "kl, reward" in alert.message and alert.step == 0
    state, out = on_step(state, step_ev(1, reward=None, non_finite=("reward",)), 1.0, CFG)
    assert kinds(out) == []
    state, out = on_step(state, step_ev(2, non_finite=("reward", "critic/score")), 2.0, CFG)
    assert kinds(out) == ["non_finite"]
    assert "critic/score" in next(o.event.message for o in out if o.event.type == "alert")
    _, again = on_step(state, step_ev(0, reward=None, non_finite=("reward", "kl")), 3.0, CFG)  # redelivered
    assert kinds(again) == []
    assert codec.loads(RunState, codec.dumps(state)).non_finite.fields == ("critic/score", "kl", "reward")


def test_non_finite_fields_remembered_are_bounded() -> None:
    names = tuple(f"m{i:04d}" for i in range(NON_FINITE_FIELDS_KEPT + 10))
    state, alerts = check_non_finite(NonFiniteState(), names, 1, 0)
    assert len(alerts) == 1 and state.saturated and len(state.fields) == NON_FINITE_FIELDS_KEPT
    assert "no further non_finite alerts" in alerts[0].message
    assert check_non_finite(state, ("new",), 2, 0) == (state, [])


# ------------------------------------------------------------------ trigger


def test_the_interval_is_read_from_the_run_config() -> None:
    assert published_interval({"eval_interval_steps": 25}) == 25
    assert published_interval({"eval_every_steps": 40.0}) == 40
    assert published_interval({"eval_interval_steps": 10, "eval_every_steps": 40}) == 10
    for bad in ({}, {"eval_interval_steps": True}, {"eval_interval_steps": 0}, {"eval_interval_steps": "25"},
                {"eval_interval_steps": 2.5}, {"eval_every_steps": None}):
        assert published_interval(bad) is None


def test_the_trigger_starts_from_the_published_interval() -> None:
    cfg = RunConfig(window=3, eval_interval=50, min_eval_interval=10, evaluate_delta=100.0)
    published = {"eval_interval_steps": 25}
    for loop, expected in (({"adaptive_interval": True}, [{"steps": 12}]), ({}, []),
                           ({"adaptive_interval": False}, [])):  # only a run that sets it gets set_eval_interval
        state, _ = on_run(RunState("run-z"), run_ev("running", config={**published, "eval_loop": loop}), 0.0, cfg)
        assert state.trigger.base_interval == 25
        commands = []
        for step in range(6):  # a fast climb: the interval halves from the trainer's 25, not from 50
            state, out = on_step(state, step_ev(step, reward=0.05 * step), float(step), cfg)
            commands += [dict(o.event.args) for o in out if o.event.type == "command"]
        assert commands == expected
    state, _ = on_run(state, run_ev("finished", 1, config={"eval_interval_steps": 99}), 9.0, cfg)
    assert state.trigger.base_interval == 25  # only `running` publishes it


def test_a_flat_start_is_not_a_plateau_until_the_run_has_learned() -> None:
    cfg = RunConfig(window=10, eval_interval=20, interval_dwell_steps=5, evaluate_delta=100.0, adaptive_interval=True)
    rnd = random.Random(7)
    rewards = [0.0] * 40 + [0.02 * i for i in range(30)] + [0.6 + rnd.uniform(-1e-3, 1e-3) for _ in range(40)]
    state, changes = RunState("run-z"), []
    for step, r in enumerate(rewards):
        state, out = on_step(state, step_ev(step, reward=r), float(step), cfg)
        changes += [(step, o.event.args["steps"]) for o in out if o.event.type == "command"]
    assert all(step >= 40 for step, _ in changes)  # nothing while the reward sat at 0
    assert changes[0][1] == 10  # fast while climbing
    on_plateau = [n for step, n in changes if step >= 70]
    assert on_plateau[:2] == [20, 40] and on_plateau == sorted(on_plateau)  # then the plateau doubles it
    assert state.trigger.learning


def test_a_noisy_flat_slope_within_its_noise_does_not_count_as_learning() -> None:
    cfg = RunConfig(window=5)
    point = SmoothedPoint(10, 0.0, 5, 0.0, 0.0, 0.004)
    state, _ = decide(TriggerState(), point, cfg, slope_se=0.002)  # t = 2 < 3
    assert not state.learning
    state, _ = decide(state, SmoothedPoint(11, 0.0, 5, 0.0, 0.0, 0.0001), cfg, slope_se=0.002)
    assert state.mode == "normal"  # the slope is in the plateau band, but the run never learned
    state, _ = decide(state, SmoothedPoint(12, 0.0, 5, 0.0, 0.0, 0.01), cfg, slope_se=0.002)
    assert state.learning
