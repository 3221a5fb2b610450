"""The evaluation scheduler: triggers, independent resets, start, adaptive commands (no broker)."""

from __future__ import annotations

import pytest

from areal_metrics.areal_train.control import apply_commands, due, from_step
from areal_metrics.areal_train.scheduler import (
    COMMAND,
    EPOCH,
    START,
    STEP,
    TIME,
    EvalScheduler,
    Trigger,
)
from areal_metrics.producers.contract.events import CommandEvent


def run_steps(s: EvalScheduler, steps: range, epoch_of=lambda step: 0, time_of=lambda step: 0.0) -> dict[int, set[str]]:
    fired = {}
    for step in steps:
        now = time_of(step)
        reasons = s.after_step(step, epoch_of(step), s.time_due(now), now)
        if reasons:
            fired[step] = reasons
    return fired


def test_step_trigger_fires_every_n_steps() -> None:
    s = EvalScheduler(every_steps=5)
    assert run_steps(s, range(1, 21)) == {5: {STEP}, 10: {STEP}, 15: {STEP}, 20: {STEP}}


def test_epoch_trigger_fires_when_epochs_complete() -> None:
    s = EvalScheduler(every_epochs=2)
    fired = run_steps(s, range(1, 31), epoch_of=lambda step: step // 4)  # 4 steps per epoch
    assert fired == {8: {EPOCH}, 16: {EPOCH}, 24: {EPOCH}}


def test_time_trigger_fires_after_the_interval_and_resets_to_the_firing_time() -> None:
    s = EvalScheduler(every_seconds=10.0, start_time=100.0)
    fired = run_steps(s, range(1, 13), time_of=lambda step: 100.0 + 3.0 * step)  # 3 s per step
    assert fired == {4: {TIME}, 8: {TIME}, 12: {TIME}}  # 112 >= 110, then 124 >= 122, 136 >= 134
    assert s.last_time == 136.0


def test_triggers_reset_only_their_own_baseline() -> None:
    s = EvalScheduler(every_steps=10, every_seconds=25.0, start_time=0.0)
    # 2 s per step: time fires at step 13 (26 s); steps fire at 10, 20, 30
    fired = run_steps(s, range(1, 31), time_of=lambda step: 2.0 * step)
    assert fired[10] == {STEP}
    assert fired[13] == {TIME}  # the step-triggered eval at 10 did not reset the time baseline
    assert fired[20] == {STEP}  # nor did the time-triggered eval at 13 reset the step baseline
    assert fired[26] == {TIME}
    assert fired[30] == {STEP}
    assert set(fired) == {10, 13, 20, 26, 30}


def test_coinciding_triggers_fire_once_with_both_reasons() -> None:
    s = EvalScheduler(every_steps=4, every_epochs=1)
    fired = run_steps(s, range(1, 9), epoch_of=lambda step: step // 4)
    assert fired == {4: {STEP, EPOCH}, 8: {STEP, EPOCH}}


def test_evaluation_before_training_happens_once_and_only_when_asked() -> None:
    s = EvalScheduler(every_steps=5, at_start=True)
    assert s.before_training() == {START}
    assert s.before_training() == set()
    assert EvalScheduler(every_steps=5).before_training() == set()
    # the start evaluation does not shift the step trigger
    assert run_steps(s, range(1, 11)) == {5: {STEP}, 10: {STEP}}


def test_no_triggers_means_no_evaluations() -> None:
    s = EvalScheduler()
    assert run_steps(s, range(1, 50), epoch_of=lambda step: step, time_of=lambda step: step * 100.0) == {}


def test_time_due_is_decided_by_the_caller() -> None:
    """The trainer passes rank 0's verdict to every rank; a rank's own clock does not matter."""
    s = EvalScheduler(every_seconds=10.0, start_time=0.0)
    assert s.after_step(1, 0, time_due=False, now=50.0) == set()  # late locally, but not agreed
    assert s.after_step(2, 0, time_due=True, now=51.0) == {TIME}
    assert s.last_time == 51.0


def command(name: str, run_id: str = "run-1", **kw) -> CommandEvent:
    return CommandEvent(run_id=run_id, command=name, **kw)


def test_set_eval_interval_changes_the_step_trigger_from_the_last_step_eval() -> None:
    s = EvalScheduler(every_steps=10)
    assert run_steps(s, range(1, 13)) == {10: {STEP}}
    applied = apply_commands([command("set_eval_interval", args={"steps": 3})], s)
    assert applied.count == 1 and s.every_steps == 3
    assert run_steps(s, range(13, 20)) == {13: {STEP}, 16: {STEP}, 19: {STEP}}


def test_set_eval_interval_turns_on_a_step_trigger_that_was_off() -> None:
    s = EvalScheduler()
    apply_commands([command("set_eval_interval", args={"steps": 4})], s)
    assert run_steps(s, range(1, 9)) == {4: {STEP}, 8: {STEP}}


def test_evaluate_now_fires_once_without_touching_other_baselines() -> None:
    s = EvalScheduler(every_steps=10)
    assert run_steps(s, range(1, 7)) == {}
    apply_commands([command("evaluate_now")], s)
    assert run_steps(s, range(7, 21)) == {7: {COMMAND}, 10: {STEP}, 20: {STEP}}


def test_scale_lr_and_stop_are_handed_to_the_trainer() -> None:
    s = EvalScheduler()
    applied = apply_commands([command("scale_lr", args={"factor": 0.5}), command("scale_lr", args={"factor": 0.5}),
                              command("stop")], s)
    assert applied.lr_factor == pytest.approx(0.25)
    assert applied.stop and applied.count == 3 and applied.restore_step is None
    assert not apply_commands([], s).stop
    rollback = apply_commands([command("scale_lr", args={"factor": 0.1, "restore_step": 8}),
                               command("scale_lr", args={"factor": 0.5, "restore_step": 16})], s)
    assert rollback.restore_step == 16 and rollback.lr_factor == pytest.approx(0.05)  # the last one's weights


def test_a_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError):
        EvalScheduler().set_step_interval(0)


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=200, deadline=None)
@given(every_steps=st.one_of(st.none(), st.integers(1, 12)), every_epochs=st.one_of(st.none(), st.integers(1, 4)),
       every_seconds=st.one_of(st.none(), st.floats(0.5, 20)), steps_per_epoch=st.integers(1, 9),
       seconds_per_step=st.lists(st.floats(0.0, 5.0), min_size=60, max_size=60))
def test_combined_triggers_fire_exactly_where_each_alone_would(every_steps, every_epochs, every_seconds,
                                                               steps_per_epoch, seconds_per_step) -> None:
    """Independence of the baselines: together they fire at the union of where each fires alone."""
    clock = [sum(seconds_per_step[:i]) for i in range(61)]

    def fired(**triggers) -> dict[int, set[str]]:
        return run_steps(EvalScheduler(**triggers), range(1, 61), epoch_of=lambda s: s // steps_per_epoch,
                         time_of=lambda s: clock[s])

    together = fired(every_steps=every_steps, every_epochs=every_epochs, every_seconds=every_seconds)
    alone = [fired(every_steps=every_steps), fired(every_epochs=every_epochs), fired(every_seconds=every_seconds)]
    union: dict[int, set[str]] = {}
    for one in alone:
        for step, reasons in one.items():
            union.setdefault(step, set()).update(reasons)
    assert together == union


# ------------------------------------------------------------ state and resume


@settings(max_examples=200, deadline=None)
@given(every_steps=st.one_of(st.none(), st.integers(1, 9)), every_seconds=st.one_of(st.none(), st.floats(0.5, 20)),
       cut=st.integers(1, 59), seconds_per_step=st.lists(st.floats(0.0, 5.0), min_size=60, max_size=60),
       shift=st.floats(-1e6, 1e6), commands=st.lists(st.integers(1, 59), max_size=3))
def test_a_restored_scheduler_fires_where_the_uninterrupted_one_does(every_steps, every_seconds, cut,
                                                                     seconds_per_step, shift, commands) -> None:
    """Save after step `cut`, restore on another clock (shifted by `shift`): the same decisions after."""
    clock = [sum(seconds_per_step[:i]) for i in range(61)]

    def decide(s: EvalScheduler, step: int, offset: float = 0.0) -> set[str]:
        if step in commands:
            s.request()
        now = clock[step] + offset
        return s.after_step(step, step // 7, s.time_due(now), now)

    whole = EvalScheduler(every_steps=every_steps, every_epochs=2, every_seconds=every_seconds, at_start=True)
    whole.before_training()
    first = EvalScheduler(every_steps=every_steps, every_epochs=2, every_seconds=every_seconds, at_start=True)
    first.before_training()
    expected = {step: decide(whole, step) for step in range(1, 61)}
    before = {step: decide(first, step) for step in range(1, cut + 1)}
    state = first.state_dict(now=clock[cut])
    restored = EvalScheduler()
    restored.load_state_dict(state, now=clock[cut] + shift)
    after = {step: decide(restored, step, shift) for step in range(cut + 1, 61)}
    assert {**before, **after} == expected
    assert restored.before_training() == set()  # a resumed run does not evaluate "before training" again


def test_state_carries_a_changed_interval_and_a_pending_request() -> None:
    s = EvalScheduler(every_steps=10)
    s.set_step_interval(3)
    s.request()
    restored = EvalScheduler()
    restored.load_state_dict(s.state_dict(now=5.0), now=100.0)
    assert restored.every_steps == 3 and restored.after_step(1, 0, False, 100.0) == {COMMAND}


def test_the_checkpoint_trigger_is_the_same_kind_of_trigger() -> None:
    t = Trigger(every_steps=10, every_seconds=30.0, start_time=0.0)
    fired = {step: t.fire(step, 0, t.time_due(step * 4.0), step * 4.0) for step in range(1, 31)}
    assert {s for s, r in fired.items() if r} == {8, 10, 16, 20, 24, 30}


def test_scale_lr_waits_for_its_step_boundary() -> None:
    now = command("scale_lr", args={"factor": 0.5})
    later = command("scale_lr", args={"factor": 0.5, "from_step": 12})
    stop = command("stop")
    ready, waiting = due([now, later, stop], step=10)
    assert ready == [now, stop] and waiting == [later]
    assert due(waiting, step=11) == ([], [later])
    assert due(waiting, step=12) == ([later], [])
    assert from_step(command("scale_lr", args={"factor": 0.5, "from_step": True})) == 0


@settings(max_examples=200, deadline=None)
@given(at_start=st.booleans(), at_end=st.booleans(), steps=st.one_of(st.none(), st.integers(1, 5)),
       epochs=st.one_of(st.none(), st.integers(1, 2)), seconds=st.one_of(st.none(), st.floats(0.5, 3.0)))
def test_a_config_says_it_evaluates_on_schedule_exactly_when_its_schedule_or_end_round_does(
        at_start, at_end, steps, epochs, seconds) -> None:
    """The trainer starts an evaluation process early on `evaluates_on_schedule`: it must agree with
    what the schedule built from the same config does over a run (10 steps, an epoch every 4, 1 s each)."""
    from areal_metrics.areal_train.config import TrainConfig

    cfg = TrainConfig(eval_at_start=at_start, eval_at_end=at_end, eval_every_steps=steps,
                      eval_every_epochs=epochs, eval_every_seconds=seconds)
    schedule = cfg.eval_schedule(now=0.0)
    fired = bool(schedule.before_training())
    for step in range(1, 11):
        now = float(step)
        fired |= bool(schedule.after_step(step, step // 4, schedule.time_due(now), now))
    assert cfg.evaluates_on_schedule == (fired or at_end)
