"""The closed loop on evaluation (areal_metrics.streams.core.eval_loop): scale_lr when the CUSUM of
the rounds' shortfall below the threshold passes its limit (alpha spent over the run's horizon), a
test that improvement stopped, a floor, a raise that waits and never cycles; per-run settings from
run.config.eval_loop. Error rates: test_streams_loop_simulation.py."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.field_rules import text_problem
from areal_metrics.streams.state import codec
from areal_metrics.producers.contract.events import EvalEvent, RunEvent, parse_event
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.eval_loop import EvalLoopState, on_consensus
from areal_metrics.streams.core.processor import RunState, on_eval, on_run
from areal_metrics.producers.contract.statistics import wilson
from areal_metrics.streams.core.voting import Consensus, RoundKey

CFG = RunConfig(lr_eval_threshold=0.5, lr_min_factor=0.25, no_improvement_rounds=3,
                lr_improve_delta=0.01, lr_apply_delay_steps=5)


def cons(step: int, acc: float, *, dataset: str = "math500", stage: str = "full", stale: bool = False,
         attempt: int = 0, n: int = 128) -> Consensus:
    low, high = wilson(acc, n)
    return Consensus(key=RoundKey("run-l", f"e{step}", dataset, stage, attempt), step=step, accuracy=acc,
                     response_length=None, votes=2, replicas=2, agreement=1.0, dissenters=(), stale=stale,
                     n_samples=n, ci_low=low, ci_high=high, n_effective=float(n))


def feed(accuracies: list[float], cfg: RunConfig = CFG, state: EvalLoopState | None = None, start: int = 10,
         n: int = 128):
    state = state or EvalLoopState()
    log = []
    for i, acc in enumerate(accuracies):
        state, alerts, commands = on_consensus(state, cons(start + 10 * i, acc, n=n), cfg)
        log.append(([a.kind for a in alerts], [c.args["factor"] for c in commands]))
    return state, log


def test_an_interval_below_the_threshold_halves_the_lr_from_a_later_step_and_the_reason_cites_it() -> None:
    state, alerts, commands = on_consensus(EvalLoopState(), cons(40, 0.25), CFG)
    [command] = commands
    assert (command.command, command.args) == ("scale_lr", {"factor": 0.5, "from_step": 45})
    low, high = wilson(0.25, 128)
    for part in ("math500/full", "step 40", "eval e40", "accuracy 0.25", f"95% CI [{low:.3f}, {high:.3f}]",
                 "128 samples", "5.66 standard errors below threshold 0.5", "CUSUM", "> limit",
                 "alpha/2 = 0.025 over a horizon of 200 rounds"):
        assert part in command.reason, part
    assert [a.kind for a in alerts] == ["eval_below_threshold"] and alerts[0].threshold == 0.5
    assert state.factor == 0.5 and state.in_breach and state.looks == 1 and state.cusum == 0.0


def test_a_point_estimate_below_the_threshold_is_not_enough() -> None:
    # 0.42 of 128 samples: its interval reaches over 0.5, so no cut (the old rule cut here)
    state, log = feed([0.45, 0.44, 0.46])
    assert log == [([], [])] * 3 and state.factor == 1.0 and state.looks == 3
    # the same accuracy on 5000 samples is evidence
    _, log = feed([0.45], n=5000)
    assert log == [(["eval_below_threshold"], [0.5])]


def test_late_looks_need_no_more_evidence_than_early_ones() -> None:
    # the same round cuts at the first look and at the 150th: the limit depends on the horizon only
    first = on_consensus(EvalLoopState(), cons(10, 0.3), CFG)[2]
    late = on_consensus(EvalLoopState(looks=149), cons(10, 0.3), CFG)[2]
    assert len(first) == 1 and len(late) == 1
    # two rounds a little below add up (each alone is not enough); a round above the threshold resets
    _, log = feed([0.35, 0.35])
    assert log == [([], []), (["eval_below_threshold"], [0.5])]
    _, log = feed([0.35, 0.6, 0.35])
    assert log == [([], [])] * 3
    # a longer horizon asks for more: the same two rounds are not enough over 100,000 rounds
    _, log = feed([0.35, 0.35], RunConfig(lr_eval_threshold=0.5, lr_horizon_rounds=100000, no_improvement_rounds=0))
    assert log == [([], [])] * 2


def test_repeating_the_same_data_cannot_cut_unless_one_round_is_past_the_reference() -> None:
    # the same prompts with the same noise and unchanged weights give the same round again and again:
    # the CUSUM grows only while a round is more than k = 1.96 standard errors below the threshold
    z = lambda acc: (0.5 - acc) / (0.25 / 128) ** 0.5  # noqa: E731
    assert z(0.42) < 1.96 < z(0.40)
    _, log = feed([0.42] * 300)
    assert all(entry == ([], []) for entry in log)
    _, log = feed([0.40] * 300)
    assert any(entry[0] == ["eval_below_threshold"] for entry in log)


def test_undecided_samples_count_right_for_the_cut() -> None:
    # 2 replicas disagree on 60 of 128 samples: decided 8 of 68 right (0.118), but with every undecided
    # sample right the round reads 68 / 128 = 0.53, above 0.5: no cut
    c = Consensus(key=RoundKey("run-l", "e10", "math500", "full", 0), step=10, accuracy=8 / 68,
                  response_length=None, votes=2, replicas=2, agreement=0.5, dissenters=(), n_samples=68,
                  n_undecided=60, ci_low=0.0, ci_high=0.6, n_effective=68.0)
    state, alerts, commands = on_consensus(EvalLoopState(), c, CFG)
    assert (alerts, commands) == ([], []) and state.cusum == 0.0


def test_one_drop_per_breach_and_restore_once_the_interval_is_back_above() -> None:
    cfg = RunConfig(lr_eval_threshold=0.5, lr_restore_margin=0.0, no_improvement_rounds=0)
    state, log = feed([0.6, 0.2, 0.25, 0.55, 0.7, 0.7, 0.7, 0.2, 0.9, 0.9, 0.9, 0.9], cfg)
    ceiling = 0.5 ** 0.5  # the geometric middle of the rate cut (1.0) and the rate set (0.5)
    assert log == [
        ([], []),
        (["eval_below_threshold"], [0.5]),
        ([], []),  # still in the breach: no second drop
        ([], []),  # 0.55 of 128: its interval still reaches under 0.5
        ([], []),  # 0.7: the breach ends; 2 rounds at the lower rate so far (0.55, 0.7)
        ([], [pytest.approx(ceiling / 0.5)]),  # the third round at or above: raised, to the ceiling only
        ([], []),
        (["eval_below_threshold"], [0.5]),  # a drop after a raise ...
        ([], []), ([], []), ([], []), ([], []),  # ... keeps the lower rate for the rest of the attempt
    ]
    assert state.factor == pytest.approx(ceiling * 0.5) and state.locked_in == 0


def test_a_raise_waits_for_rounds_at_the_lower_rate_and_a_round_below_starts_the_count_again() -> None:
    cfg = RunConfig(lr_eval_threshold=0.5, no_improvement_rounds=0, lr_raise_after_rounds=3,
                    lr_apply_delay_steps=15)
    # the cut at step 20 applies from step 35: the round at step 30 is still at the old rate
    state, log = feed([0.7, 0.1, 0.9, 0.9, 0.45, 0.9, 0.9, 0.9], cfg)
    raises = [i for i, (_, factors) in enumerate(log) if factors and factors[0] > 1]
    assert raises == [7]  # steps 40, 50 count; 0.45 at step 60 resets; 70, 80, 90 raise
    # a new attempt is no longer locked
    locked = EvalLoopState(factor=0.25, lowered_from=0, locked_in=0, ceiling=1.0)
    state, _, commands = on_consensus(locked, cons(10, 0.9, attempt=0), cfg)
    assert commands == [] and state.lowered_from is None


def test_the_raise_is_capped_at_the_factor_of_one() -> None:
    cfg = RunConfig(lr_eval_threshold=0.5, lr_restore_factor=4.0, no_improvement_rounds=0, lr_factor=0.25,
                    lr_min_factor=0.0625)
    state, log = feed([0.2, 0.9, 0.9, 0.9], cfg)
    assert [f for _, fs in log for f in fs] == [0.25, 2.0] and state.factor == 0.5  # ceiling sqrt(0.25)


def test_with_rollback_a_drop_restores_the_round_before_when_it_was_at_or_above_the_threshold() -> None:
    cfg = RunConfig(lr_eval_threshold=0.5, lr_rollback=True, no_improvement_rounds=0, lr_apply_delay_steps=2)
    state = EvalLoopState()
    commands_by_step = {}
    for step, acc in ((0, 0.7), (8, 0.1), (16, 0.75), (24, 0.6), (32, 0.75)):
        state, _, commands = on_consensus(state, cons(step, acc), cfg)
        commands_by_step[step] = [c.args for c in commands]
    assert commands_by_step[8] == [{"factor": 0.5, "from_step": 10, "restore_step": 0}]
    assert commands_by_step[16] == commands_by_step[24] == []  # the breach ends at 16; the raise waits
    assert commands_by_step[32] == [{"factor": pytest.approx(2 ** 0.5), "from_step": 34}]  # third round: no weights


def test_the_round_of_restored_weights_at_the_cuts_step_does_not_count_for_the_raise() -> None:
    """The reference trainer evaluates restored weights at once, at the step the cut applies from: that round
    replays the good one before any update at the lower rate, so with raise_after_rounds 1 it raises nothing;
    the next good round does. Without a rollback the round at from_step counts, as before."""
    for rollback, raised_at in ((True, 11), (False, 10)):
        cfg = RunConfig(lr_eval_threshold=0.5, lr_rollback=rollback, no_improvement_rounds=0, lr_apply_delay_steps=2,
                        lr_raise_after_rounds=1, lr_restore_margin=0.0)
        state, _, commands = on_consensus(EvalLoopState(), cons(0, 0.9), cfg)
        state, _, commands = on_consensus(state, cons(8, 0.1), cfg)
        assert commands[0].args["from_step"] == 10
        raises = []
        for step in (10, 11):
            state, _, commands = on_consensus(state, cons(step, 0.9), cfg)
            raises += [step for c in commands if c.args["factor"] > 1]
        assert raises == [raised_at]


def test_rollback_restores_the_latest_round_shown_good_also_when_the_drop_is_found_a_round_late() -> None:
    cfg = RunConfig(lr_eval_threshold=0.5, lr_rollback=True, no_improvement_rounds=0)
    state, restored = EvalLoopState(), {}
    # 0.38 at step 10 is not enough alone; with step 20's it is
    for step, acc in ((0, 0.8), (10, 0.35), (20, 0.35), (30, 0.9), (40, 0.1)):
        state, _, commands = on_consensus(state, cons(step, acc), cfg)
        restored.update({step: c.args.get("restore_step") for c in commands if c.args["factor"] < 1})
    assert restored == {20: 0, 40: 30}  # two rounds back; then the round that ended the breach


def test_rollback_names_no_step_when_no_round_was_shown_good_or_it_was_of_another_attempt() -> None:
    cfg = RunConfig(lr_eval_threshold=0.5, lr_rollback=True, no_improvement_rounds=0)
    # the round before read 0.45 (under the threshold, not shown below it): its weights are no better
    state, _, _ = on_consensus(EvalLoopState(), cons(10, 0.45), cfg)
    _, _, [command] = on_consensus(state, cons(20, 0.1), cfg)
    assert "restore_step" not in command.args and "restored" not in command.reason
    # 0.55 of 128 reads above 0.5, but its interval reaches under it: not shown to be good
    state, _, _ = on_consensus(EvalLoopState(), cons(10, 0.55), cfg)
    _, _, [command] = on_consensus(state, cons(20, 0.1), cfg)
    assert "restore_step" not in command.args
    # the same accuracy on 2,000 samples is: restored
    state, _, _ = on_consensus(EvalLoopState(), cons(10, 0.55, n=2000), cfg)
    _, _, [command] = on_consensus(state, cons(20, 0.1), cfg)
    assert command.args["restore_step"] == 10
    # the first round of the run: nothing before it
    _, _, [command] = on_consensus(EvalLoopState(), cons(10, 0.1), cfg)
    assert "restore_step" not in command.args
    # a resumed attempt: the weights of the earlier attempt's round are not the trainer's to restore
    state, _, _ = on_consensus(EvalLoopState(), cons(10, 0.8, attempt=0), cfg)
    _, _, [command] = on_consensus(state, cons(12, 0.1, attempt=1), cfg)
    assert "restore_step" not in command.args
    # rollback off (the default): never
    state, _, _ = on_consensus(EvalLoopState(), cons(10, 0.8), CFG)
    _, _, [command] = on_consensus(state, cons(20, 0.1), CFG)
    assert "restore_step" not in command.args


def test_the_reason_of_a_rollback_names_the_step_restored() -> None:
    cfg = RunConfig(lr_eval_threshold=0.5, lr_rollback=True, no_improvement_rounds=0)
    state, _, _ = on_consensus(EvalLoopState(), cons(10, 0.8), cfg)
    _, [alert], [command] = on_consensus(state, cons(20, 0.1), cfg)
    assert command.args["restore_step"] == 10
    assert command.reason.endswith("; weights of step 10 restored first (the latest round whose 95% CI lay at or "
                                   "above 0.5)")
    assert alert.kind == "eval_below_threshold"


def test_only_watched_non_stale_newer_rounds_with_decided_samples_count() -> None:
    state, _, commands = on_consensus(EvalLoopState(), cons(10, 0.9, dataset="math500"), CFG)
    assert state.dataset == "math500" and commands == []
    for ignored in (cons(20, 0.1, stage="quick"), cons(20, 0.1, stale=True), cons(20, 0.1, dataset="aime24"),
                    cons(10, 0.1), cons(5, 0.1), cons(30, 0.0, n=0)):
        assert on_consensus(state, ignored, CFG) == (state, [], [])
    pinned = RunConfig(lr_eval_threshold=0.5, lr_eval_dataset="aime24")
    assert on_consensus(EvalLoopState(), cons(10, 0.1), pinned)[2] == []
    assert len(on_consensus(EvalLoopState(), cons(10, 0.1, dataset="aime24"), pinned)[2]) == 1
    quick = RunConfig(lr_eval_threshold=0.5, lr_eval_stage="quick")
    assert len(on_consensus(EvalLoopState(), cons(10, 0.1, stage="quick"), quick)[2]) == 1
    # a resumed attempt's rounds count again from its own (earlier) steps
    assert len(on_consensus(state, cons(5, 0.1, attempt=1), CFG)[2]) == 1


def test_a_flat_run_is_found_to_have_stopped_improving_and_the_reason_cites_the_test() -> None:
    cfg = RunConfig(no_improvement_rounds=3)  # no threshold: the alert only
    state = EvalLoopState()
    found = []
    for i, acc in enumerate([0.300, 0.301, 0.299, 0.300, 0.300, 0.301, 0.300, 0.299]):
        state, alerts, commands = on_consensus(state, cons(10 * i, acc, n=20000), cfg)
        assert commands == []
        found += [(i, a) for a in alerts]
    [(i, alert)] = found[:1]
    # the first test (after patience + 1 rounds, 3 differences: a t quantile on 3 degrees of freedom) is not
    # enough; the second, over 6 rounds, is
    assert i == 6 and alert.kind == "no_improvement"
    for part in ("improvement stopped", "slope", "per round of 10 steps", "dispersion", "upper bound",
                 "one of 67 tests over the horizon", "< 0.01"):
        assert part in alert.message, part
    assert len(state.window) == 1  # the rounds started over after the alert


def test_a_noisy_round_below_a_noisy_best_is_not_a_plateau() -> None:
    # improving by 0.05 a round, one round dipping: the old rule counted rounds without a new best
    accuracies = [0.20, 0.25, 0.30, 0.35, 0.28, 0.45, 0.50, 0.47, 0.60, 0.65, 0.70, 0.68]
    _, log = feed(accuracies, RunConfig(lr_eval_threshold=0.05, no_improvement_rounds=2))
    assert all(kinds == [] and factors == [] for kinds, factors in log)


def test_the_loop_settings_come_from_the_runs_own_config() -> None:
    def run(loop: dict | None, cfg: RunConfig = RunConfig()):
        config = {} if loop is None else {"eval_loop": loop}
        state, out = on_run(RunState("run-l"), RunEvent(run_id="run-l", node="n0", status="running", world_size=1,
                                                         config=config, ts=1.0, event_id="r"), 0.0, cfg)
        ev = EvalEvent(run_id="run-l", node="n0", eval_id="r60", step=60, dataset="math500", stage="full",
                       accuracy=0.1, verdicts=(1,) + (0,) * 127, replicas=1, ts=5.0, event_id="r60")
        state, more = on_eval(state, ev, 1.0, cfg)
        return [(o.event.type, getattr(o.event, "command", None) or getattr(o.event, "kind", None))
                for o in out + more]

    cut = [("eval_consensus", None), ("alert", "eval_below_threshold"), ("command", "scale_lr")]
    assert run({"threshold": 0.5}) == cut  # the worker has no threshold: the run's own applies
    assert run(None) == [("eval_consensus", None)]
    assert run({}, CFG) == cut  # a missing key takes the worker's setting
    assert run({"enabled": False}, CFG) == [("eval_consensus", None)]
    assert run({"threshold": 0.02}, CFG) == [("eval_consensus", None)]  # 1 of 128 is not evidence of < 0.02
    assert run({"threshold": 0.5, "alpha": 7, "colour": "red"}) == [
        ("alert", "invalid_config"), ("alert", "invalid_config"), *cut]  # bad keys named, the rest applies


def test_a_bad_eval_loop_setting_is_named_in_an_alert() -> None:
    ev = RunEvent(run_id="run-l", node="n0", status="running", world_size=1, ts=1.0, event_id="r",
                  config={"eval_loop": {"alpha": 7}})
    _, out = on_run(RunState("run-l"), ev, 0.0, RunConfig())
    [alert] = [o.event for o in out]
    assert alert.kind == "invalid_config" and "run.config.eval_loop.alpha" in alert.message
    assert "(0, 0.5]" in alert.message and "7" in alert.message


rounds = st.lists(
    st.tuples(st.floats(0, 1), st.integers(-2, 30), st.sampled_from(["full", "full", "quick"]), st.booleans(),
              st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(rounds, st.floats(0, 1), st.sampled_from([0.5, 0.25, 0.9]), st.sampled_from([0.01, 0.1, 0.3, 1.0]),
       st.sampled_from([1.5, 2.0, 8.0]), st.integers(0, 4), st.sampled_from([1, 128, 100000]))
def test_any_sequence_of_consensus_results_keeps_the_factor_within_floor_and_one(
    seq, threshold, lr_factor, floor, restore, patience, n
) -> None:
    cfg = RunConfig(lr_eval_threshold=threshold, lr_factor=lr_factor, lr_min_factor=floor,
                    lr_restore_factor=restore, no_improvement_rounds=patience)
    state, cumulative, step, attempt = EvalLoopState(), 1.0, 0, 0
    per_round: Counter = Counter()
    dropped = False
    for acc, jump, stage, stale, bump in seq:
        attempt += bump == 2 and jump < 0  # now and then a resumed attempt
        step = max(0, step + jump)
        c = cons(step, acc, stage=stage, stale=stale, attempt=attempt, n=n)
        state, _, commands = on_consensus(state, c, cfg)
        assert len(commands) <= 1
        per_round[(attempt, step)] += len(commands)
        for command in commands:
            factor = command.args["factor"]
            assert command.command == "scale_lr" and command.args["from_step"] == step + cfg.lr_apply_delay_steps
            if factor > 1:
                assert dropped and cumulative < 1  # a restore only after a drop
            else:
                dropped = True
            cumulative *= factor
            assert floor - 1e-9 <= cumulative <= 1 + 1e-9
        assert state.factor == pytest.approx(cumulative)
    assert all(n <= 1 for n in per_round.values())  # never two commands for one round


def test_the_processor_sends_one_run_wide_command_with_the_step_it_applies_from() -> None:
    state = RunState("run-l")
    out = []
    for node in ("n0", "n1"):
        ev = EvalEvent(run_id="run-l", node=node, eval_id="r60", step=60, dataset="math500", stage="full",
                       accuracy=0.125, verdicts=(1, 0, 0, 0, 0, 0, 0, 0) * 16, replicas=2, ts=5.0,
                       event_id=f"r60-{node}")
        state, out = on_eval(state, ev, 1.0, CFG)
    kinds = [(o.event.type, getattr(o.event, "command", getattr(o.event, "kind", None))) for o in out]
    assert kinds == [("eval_consensus", None), ("alert", "eval_below_threshold"), ("command", "scale_lr")]
    consensus = out[0].event
    assert (consensus.n_samples, consensus.n_undecided) == (128, 0)
    assert consensus.ci_low < 0.125 < consensus.ci_high < 0.5
    command = out[-1].event
    assert command.target_node is None and dict(command.args) == {"factor": 0.5, "from_step": 65}
    assert "math500/full" in command.reason and "0.125" in command.reason
    assert parse_event(command.to_json()).to_dict() == command.to_dict()
    assert codec.loads(RunState, codec.dumps(state)).eval_loop == state.eval_loop


# what a run event can carry: storage-safe text (the contract refuses NUL and lone surrogates)
def test_a_config_of_thousands_of_refused_keys_makes_a_bounded_number_of_alerts() -> None:
    from areal_metrics.streams.core.processor import REFUSED_KEYS_ALERTS

    ev = RunEvent(run_id="run-l", node="n0", status="running", world_size=1, ts=1.0, event_id="r",
                  config={"eval_loop": {f"k{i}": 1 for i in range(9000)}})
    _, out = on_run(RunState("run-l"), ev, 0.0, RunConfig())
    assert len(out) == REFUSED_KEYS_ALERTS + 1 and all(o.event.kind == "invalid_config" for o in out)
    assert "8992 more keys refused, the first: run.config.eval_loop.k8" in out[-1].event.message


safe_text = st.text(max_size=20).filter(lambda s: text_problem(s) is None)
json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
                           | safe_text, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(safe_text.filter(lambda s: len(s) <= 8), inner, max_size=3), max_leaves=8)
loop_keys = st.sampled_from(["enabled", "dataset", "stage", "threshold", "alpha", "patience_rounds", "factor",
                             "min_factor", "adaptive_interval", "colour"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, st.dictionaries(loop_keys, json_values, max_size=6)))
def test_any_eval_loop_a_run_sends_is_taken_or_named_never_a_crash(loop) -> None:
    ev = RunEvent(run_id="run-l", node="n0", status="running", world_size=1, ts=1.0, event_id="r",
                  config={"eval_loop": loop})
    state, out = on_run(RunState("run-l"), ev, 0.0, RunConfig())
    named = [o.event.message for o in out]
    assert all(o.event.kind == "invalid_config" and "run.config.eval_loop" in m for o, m in zip(out, named))
    taken = dict(state.loop_overrides)
    RunConfig().with_overrides(taken)  # what was taken is a valid config
    if isinstance(loop, dict):
        assert len(taken) + len(named) == len(loop)  # every key either taken or named
    # and the state round-trips through the worker's codec
    assert codec.loads(RunState, codec.dumps(state)).loop_overrides == state.loop_overrides


def test_the_horizon_comes_from_the_run_its_total_steps_and_interval_else_the_worker() -> None:
    def horizon(config: dict) -> str:
        state, _ = on_run(RunState("run-l"), RunEvent(run_id="run-l", node="n0", status="running", world_size=1,
                                                      config=config, ts=1.0, event_id="r"), 0.0, CFG)
        ev = EvalEvent(run_id="run-l", node="n0", eval_id="r60", step=60, dataset="math500", stage="full",
                       accuracy=0.1, verdicts=(1,) + (0,) * 127, replicas=1, ts=5.0, event_id="r60")
        _, out = on_eval(state, ev, 1.0, CFG)
        [command] = [o.event for o in out if o.event.type == "command"]
        return command.reason.split("over a horizon of ")[1].split(" ")[0]

    assert horizon({}) == "200"  # the worker's setting
    assert horizon({"total_steps": 400, "eval_interval_steps": 8}) == "50"
    assert horizon({"total_steps": 401, "eval_interval_steps": 8}) == "51"  # rounded up
    assert horizon({"total_steps": 400}) == "200"  # no interval: the worker's
    assert horizon({"total_steps": 400, "eval_interval_steps": 8, "eval_loop": {"horizon_rounds": 1000}}) == "1000"
    assert horizon({"total_steps": "many", "eval_interval_steps": 8}) == "200"


def test_a_longer_horizon_keeps_the_false_alarm_rate_with_a_higher_limit() -> None:
    from areal_metrics.streams.core.eval_loop import cusum_design

    (k, h50), (_, h200), (_, h2000) = (cusum_design(0.05, n) for n in (50, 200, 2000))
    assert k == pytest.approx(1.959964, abs=1e-6) and h50 < h200 < h2000


def test_undecided_samples_never_make_a_cut() -> None:
    """Issue 40, item 1: a stuck grader at two replicas leaves every sample the honest node got right
    undecided; the decided ones read 0.0. The threshold test reads the optimistic side (undecided
    counted right: 0.28 of 128 here, over a threshold of 0.2), so no cut; the same round with those
    samples decided wrong is cut."""
    cfg = RunConfig(lr_eval_threshold=0.2)
    from msgspec.structs import replace

    stuck = replace(cons(40, 0.0, n=92), n_undecided=36)
    _, alerts, commands = on_consensus(EvalLoopState(), stuck, cfg)
    assert alerts == [] and commands == []
    _, alerts, commands = on_consensus(EvalLoopState(), cons(40, 0.0, n=128), cfg)
    assert [c.command for c in commands] == ["scale_lr"]


def test_eval_loop_settings_that_break_a_rule_across_knobs_are_refused_whole_at_the_run_event(monkeypatch) -> None:
    """Each key is checked alone; the run's config applies them at every later event, so a set that
    a rule across knobs refuses (none of today's rules names an eval_loop knob: this one is made up,
    a floor above the factor) is refused at the run event, named, and never raises later."""
    real = RunConfig.cross_check

    def floor_below_factor(self: RunConfig) -> None:
        real(self)
        if self.lr_min_factor > self.lr_factor:
            raise ConfigError("lr_min_factor: must be <= lr_factor")

    monkeypatch.setattr(RunConfig, "cross_check", floor_below_factor)
    ev = RunEvent(run_id="run-l", node="n0", status="running", world_size=1, ts=1.0, event_id="r",
                  config={"eval_loop": {"threshold": 0.5, "factor": 0.2, "min_factor": 0.5}})
    state, out = on_run(RunState("run-l"), ev, 0.0, RunConfig())
    [alert] = [o.event for o in out]
    assert alert.kind == "invalid_config" and "lr_min_factor: must be <= lr_factor" in alert.message
    assert dict(state.loop_overrides) == {}  # the worker's settings apply
    result = EvalEvent(run_id="run-l", node="n0", eval_id="r60", step=60, dataset="math500", stage="full",
                       accuracy=0.1, verdicts=(1,) + (0,) * 127, replicas=1, ts=5.0, event_id="r60")
    on_eval(state, result, 1.0, RunConfig())  # does not raise


def test_a_loop_state_recorded_before_both_readings_were_kept_tests_its_plateau_as_soon() -> None:
    """A state from before the plateau rule read both ends (window_low empty) tests on the next due round,
    its one reading standing for both, as a state recorded now does; it waited 2 x patience rounds first."""
    from msgspec.structs import replace

    cfg = RunConfig()
    patience = cfg.no_improvement_rounds

    def flat(step: int) -> Consensus:
        return Consensus(key=RoundKey("r", f"e{step}", "d", cfg.lr_eval_stage, 0), step=step, accuracy=0.5,
                         response_length=None, votes=1, replicas=1, agreement=1.0, dissenters=(), n_samples=2000,
                         ci_low=0.47, ci_high=0.53, n_effective=2000.0)

    def rounds_to_plateau(state: EvalLoopState, first: int) -> int | None:
        for i in range(40):
            state, alerts, _ = on_consensus(state, flat((first + i) * 10), cfg)
            if any(a.kind == "no_improvement" for a in alerts):
                return i + 1
        return None

    state = EvalLoopState()
    for r in range(1, 2 * patience + 1):
        state, _, _ = on_consensus(state, flat(r * 10), cfg)
    now = replace(state, since_test=patience - 1)
    before = replace(now, window_low=(), dispersion_low=(0.0, 0), last_round_low=None)
    assert rounds_to_plateau(now, 2 * patience + 1) == rounds_to_plateau(before, 2 * patience + 1) == 1
    # a record written before (no such fields) decodes with them at their defaults
    import msgspec

    written_before = {k: v for k, v in msgspec.to_builtins(before).items()
                      if k not in ("window_low", "dispersion_low", "last_round_low")}
    assert codec.loads(EvalLoopState, codec.dumps(written_before)) == before


def test_the_cut_reads_each_round_as_its_interval_does() -> None:
    """One rule for the number shown and the decision: two nodes at 2 replicas tie on every sample of
    prompts 0 and 1 (8 of 32, 4 samples a prompt); the loop's reading of the round, each undecided sample
    counted right (the cut) or wrong (the plateau's low side), is the accuracy and effective size the
    interval's end stands on (statistics.side_reading of the same clusters), not the decided samples' size
    scaled to the round (32 effective samples where the interval's high end stands on 23.2)."""
    from areal_metrics.producers.contract.statistics import proportion_interval, side_reading, with_undecided
    from areal_metrics.streams.core.eval_loop import optimistic, pessimistic

    truth = [int((i * 7) % 5 < 2) for i in range(32)]  # prompt p: samples 4p..4p+3
    other = [1 - v if i < 8 else v for i, v in enumerate(truth)]  # disagrees on prompts 0 and 1
    state = RunState("run-l")
    out = []
    for node, verdicts in (("a", truth), ("b", other)):
        ev = EvalEvent(run_id="run-l", node=node, eval_id="e10", step=10, dataset="math500", replicas=2,
                       verdicts=verdicts, accuracy=sum(verdicts) / 32, metrics={"samples_per_prompt": 4}, ts=1.0)
        state, got = on_eval(state, ev, 1.0, CFG)
        out += got
    [c] = [o for o in state.votes.last_good.values()]
    decided = {p: tuple(truth[4 * p:4 * p + 4]) for p in range(2, 8)}
    assert (c.n_samples, c.n_undecided) == (24, 8)
    for verdict, reading in ((1, optimistic(c)), (0, pessimistic(c))):
        assert reading == pytest.approx(side_reading(decided, {0: 4, 1: 4}, verdict), rel=1e-12)
    high = proportion_interval(with_undecided(decided, {0: 4, 1: 4}, 1))[1]
    assert c.ci_high == pytest.approx(high, rel=1e-12)
    assert optimistic(c)[1] != pytest.approx(c.n_effective * 32 / 24, rel=0.05)  # the rule it replaced
