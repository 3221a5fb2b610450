"""The closed loop on evaluation (areal_metrics.streams.core.eval_loop): scale_lr with a floor and a restore, no_improvement."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.streams.state import codec
from areal_metrics.producers.contract.events import EvalEvent, parse_event
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.eval_loop import EvalLoopState, on_consensus
from areal_metrics.streams.core.processor import RunState, on_eval
from areal_metrics.streams.core.voting import Consensus, RoundKey

CFG = RunConfig(lr_eval_threshold=0.5, lr_restore_margin=0.05, lr_min_factor=0.25, no_improvement_rounds=3,
                lr_improve_delta=0.01, lr_apply_delay_steps=5)


def cons(step: int, acc: float, *, dataset: str = "math500", stage: str = "full", stale: bool = False,
         attempt: int = 0) -> Consensus:
    return Consensus(key=RoundKey("run-l", f"e{step}", dataset, stage, attempt), step=step, accuracy=acc,
                     response_length=None, votes=2, replicas=2, agreement=1.0, dissenters=(), stale=stale)


def feed(accuracies: list[float], cfg: RunConfig = CFG, state: EvalLoopState | None = None, start: int = 10):
    state = state or EvalLoopState()
    log = []
    for i, acc in enumerate(accuracies):
        state, alerts, commands = on_consensus(state, cons(start + 10 * i, acc), cfg)
        log.append(([a.kind for a in alerts], [c.args["factor"] for c in commands]))
    return state, log


def test_falling_below_the_threshold_halves_the_lr_from_a_later_step_and_names_the_evaluation() -> None:
    state, alerts, commands = on_consensus(EvalLoopState(), cons(40, 0.42), CFG)
    [command] = commands
    assert (command.command, command.args) == ("scale_lr", {"factor": 0.5, "from_step": 45})
    for part in ("math500/full", "step 40", "eval e40", "0.42", "threshold 0.5"):
        assert part in command.reason
    assert [a.kind for a in alerts] == ["eval_below_threshold"] and alerts[0].threshold == 0.5
    assert state.factor == 0.5 and state.in_breach


def test_one_drop_per_breach_then_no_improvement_then_the_floor() -> None:
    _, log = feed([0.4, 0.39, 0.41, 0.40, 0.40, 0.39, 0.40, 0.41, 0.40, 0.40])
    assert log == [
        (["eval_below_threshold"], [0.5]),  # the breach begins
        ([], []), ([], []),
        (["no_improvement"], [0.5]),  # 3 rounds without beating 0.4 + 0.01: cumulative 0.25, the floor
        ([], []), ([], []),
        (["no_improvement"], []),  # at the floor: the alert only
        ([], []), ([], []),
        (["no_improvement"], []),
    ]


def test_recovery_restores_the_lr_once_and_never_above_one() -> None:
    cfg = RunConfig(lr_eval_threshold=0.5, lr_restore_margin=0.05, no_improvement_rounds=0)
    state, log = feed([0.6, 0.45, 0.52, 0.56, 0.7, 0.3, 0.8], cfg)
    assert log == [
        ([], []),
        (["eval_below_threshold"], [0.5]),
        ([], []),  # above the threshold but not above threshold + margin: still in the breach
        ([], [2.0]),  # recovered: back to 1.0
        ([], []),
        (["eval_below_threshold"], [0.5]),
        ([], [2.0]),
    ]
    assert state.factor == 1.0


def test_the_restore_is_capped_at_the_factor_of_one() -> None:
    cfg = RunConfig(lr_eval_threshold=0.5, lr_restore_factor=4.0, no_improvement_rounds=0)
    state, log = feed([0.4, 0.9], cfg)
    assert [f for _, fs in log for f in fs] == [0.5, 2.0] and state.factor == 1.0


def test_only_full_stage_non_stale_newer_rounds_of_the_watched_dataset_count() -> None:
    state, _, commands = on_consensus(EvalLoopState(), cons(10, 0.9, dataset="math500"), CFG)
    assert state.dataset == "math500" and commands == []
    for ignored in (cons(20, 0.1, stage="quick"), cons(20, 0.1, stale=True), cons(20, 0.1, dataset="aime24"),
                    cons(10, 0.1), cons(5, 0.1)):
        assert on_consensus(state, ignored, CFG) == (state, [], [])
    pinned = RunConfig(lr_eval_threshold=0.5, lr_eval_dataset="aime24")
    assert on_consensus(EvalLoopState(), cons(10, 0.1), pinned)[2] == []
    assert len(on_consensus(EvalLoopState(), cons(10, 0.1, dataset="aime24"), pinned)[2]) == 1
    # a resumed attempt's rounds count again from its own (earlier) steps
    assert len(on_consensus(state, cons(5, 0.1, attempt=1), CFG)[2]) == 1


def test_without_a_threshold_the_loop_sends_no_command_but_still_says_no_improvement() -> None:
    _, log = feed([0.3, 0.3, 0.3, 0.3], RunConfig(no_improvement_rounds=3))
    assert log == [([], []), ([], []), ([], []), (["no_improvement"], [])]


rounds = st.lists(
    st.tuples(st.floats(0, 1), st.integers(-2, 30), st.sampled_from(["full", "full", "quick"]), st.booleans(),
              st.integers(0, 2)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(rounds, st.floats(0, 1), st.sampled_from([0.5, 0.25, 0.9]), st.sampled_from([0.01, 0.1, 0.3, 1.0]),
       st.sampled_from([1.5, 2.0, 8.0]), st.integers(0, 4))
def test_any_sequence_of_consensus_results_keeps_the_factor_within_floor_and_one(
    seq, threshold, lr_factor, floor, restore, patience
) -> None:
    cfg = RunConfig(lr_eval_threshold=threshold, lr_factor=lr_factor, lr_min_factor=floor,
                    lr_restore_factor=restore, no_improvement_rounds=patience)
    state, cumulative, step, attempt = EvalLoopState(), 1.0, 0, 0
    per_round: Counter = Counter()
    dropped = False
    for acc, jump, stage, stale, bump in seq:
        attempt += bump == 2 and jump < 0  # now and then a resumed attempt
        step = max(0, step + jump)
        c = cons(step, acc, stage=stage, stale=stale, attempt=attempt)
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
                       accuracy=0.25, verdicts=(1, 0, 0, 0), replicas=2, ts=5.0, event_id=f"r60-{node}")
        state, out = on_eval(state, ev, 1.0, CFG)
    kinds = [(o.event.type, getattr(o.event, "command", getattr(o.event, "kind", None))) for o in out]
    assert kinds == [("eval_consensus", None), ("alert", "eval_below_threshold"), ("command", "scale_lr")]
    command = out[-1].event
    assert command.target_node is None and dict(command.args) == {"factor": 0.5, "from_step": 65}
    assert "math500/full" in command.reason and "0.25" in command.reason
    assert parse_event(command.to_json()).to_dict() == command.to_dict()
    assert codec.loads(RunState, codec.dumps(state)).eval_loop == state.eval_loop
