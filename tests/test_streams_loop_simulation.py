"""The closed loop's rates, measured by the seeded simulation of the worker's real decision code
(tests/loop_simulation.py): 512 samples a round, alpha 0.05, threshold 0.30, horizon 200 rounds.
Small but meaningful runs here; `python -m tests.loop_simulation 1000` gives the table
docs/STREAMS.md quotes (with its Monte-Carlo errors)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from areal_metrics.streams.core.processor import RunState, on_eval
from tests import loop_simulation as sim


def rate(logs, hit) -> float:
    return sim.share(logs, hit)[0]


def test_the_shortcut_for_one_node_is_what_the_vote_makes_of_its_round() -> None:
    # the long runs skip the vote for one honest node: its consensus must be the worker's own
    ev = sim.Evaluation(sim.World(jitter=0.02), np.random.default_rng(3))
    for r, mu in enumerate((0.3, 0.45, 0.1)):
        table = ev.verdicts(mu)
        direct = sim.one_node_consensus(r, table)
        ev.verdicts = lambda _mu, t=table: t  # the same table through the vote
        [event] = ev.events(r, mu)
        _, out = on_eval(RunState("sim"), event, 0.0, sim.CFG)
        voted = next(o.event for o in out if o.event.type == "eval_consensus")
        assert (voted.accuracy, voted.n_samples) == (direct.accuracy, direct.n_samples)
        assert (voted.ci_low, voted.ci_high) == pytest.approx((direct.ci_low, direct.ci_high))
        del ev.verdicts


def test_a_run_at_the_threshold_for_150_rounds_is_cut_in_at_most_alpha_of_runs() -> None:
    logs = sim.simulate(120, 27, sim.at_threshold(), sim.CFG, sim.INDEPENDENT)
    assert rate(logs, sim.any_cut) <= 0.05
    # the same data every round (fixed set, fixed noise, unchanged weights): no accumulation past alpha / 2
    steady = dataclasses.replace(sim.PRODUCT, nodes=1, replicas=1, jitter=0.0)
    logs = sim.simulate(120, 28, sim.at_threshold(60), sim.CFG, steady)
    assert rate(logs, sim.any_cut) <= 0.05


def test_a_drop_is_cut_within_two_rounds_as_late_in_the_run_as_early() -> None:
    late = sim.simulate(120, 29, sim.drop_after(150, after=2), sim.CFG, sim.INDEPENDENT)
    early = sim.simulate(120, 30, sim.drop_after(5, after=2), sim.CFG, sim.INDEPENDENT)
    assert rate(late, sim.cut_within(150, 2)) >= 0.80 and rate(early, sim.cut_within(5, 2)) >= 0.80
    # and the good rounds before it are not cut
    assert rate(late, lambda log: any(r < 150 for r in log.threshold_cuts)) <= 0.05


def test_the_simulation_fails_a_rule_that_asks_far_more_evidence(monkeypatch) -> None:
    # the simulation can fail a rule that has gone blind (as the old spending had by its 150th look:
    # a single round had to read 4.8 standard errors below): a CUSUM limit of 10
    from areal_metrics.streams.core import eval_loop

    strict = eval_loop.cusum_design(0.05, 200)[0], 10.0
    monkeypatch.setattr(eval_loop, "cusum_design", lambda alpha, horizon: strict)
    late = sim.simulate(60, 29, sim.drop_after(150, after=2), sim.CFG, sim.INDEPENDENT)
    assert rate(late, sim.cut_within(150, 2)) < 0.5


def test_the_plateau_rule_keeps_its_budget_under_jitter_at_its_null_boundary() -> None:
    # improving by exactly lr_improve_delta (0.01) a round, the round's true accuracy wobbling with SD 0.05
    jittery = sim.World(jitter=0.05)
    logs = sim.simulate(120, 31, sim.improving_at_boundary(40), sim.CFG, jittery)
    assert rate(logs, lambda log: bool(log.plateau)) <= 0.025


def test_a_stuck_grader_at_two_replicas_never_makes_a_cut() -> None:
    # 2 ranks at 2 replicas, rank 1's grader returns 0: the decided samples read ~0, the loop does not cut
    stuck = dataclasses.replace(sim.PRODUCT, nodes=2, replicas=2, faulty=1)
    logs = sim.simulate(6, 32, [sim.GOOD] * 12, sim.CFG, stuck)
    assert all(log.undecided == 12 for log in logs)
    assert rate(logs, sim.any_cut) == 0.0


def test_no_rollback_cycle_with_a_trainer_that_collapses_at_the_full_rate() -> None:
    logs = [sim.run_once(sim.collapsing_trainer(), np.random.default_rng(40 + i), sim.ROLLBACK, sim.PRODUCT, 20)
            for i in range(6)]
    assert all(len(log.threshold_cuts) <= 1 and len(log.raises) <= 1 for log in logs)
    assert all(len(log.threshold_cuts) == 1 and log.restored for log in logs)  # the collapse was cut and rolled back
    # a trainer that collapses at any rate above the cut one: one raise, then the lower rate stays
    logs = [sim.run_once(sim.collapsing_trainer(0.6), np.random.default_rng(50 + i), sim.ROLLBACK, sim.PRODUCT, 20)
            for i in range(6)]
    assert all(len(log.threshold_cuts) <= 2 and len(log.raises) <= 1 for log in logs)


def test_the_rollback_names_good_weights_and_not_the_round_under_the_threshold() -> None:
    rates = sim.rollback_rates(60, seed=60)
    assert rates["rollback, collapse 0.40 -> 0.10 after 20 rounds: the cut names a good round"][0] >= 0.90
    assert rates["rollback, collapse 0.40 -> 0.10 after 20 rounds: the cut names a round under the threshold"][0] == 0
    assert rates["rollback, slide 0.40 -> 0.27 -> 0.10 after 20 rounds: the cut names a good round"][0] >= 0.90
    assert rates["rollback, slide 0.40 -> 0.27 -> 0.10 after 20 rounds: the cut names a round under the "
                 "threshold"][0] <= 0.05
