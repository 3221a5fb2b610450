"""The closed loop's error rates, measured by a seeded simulation through the worker's real
code (tests/loop_simulation.py): 6,000 runs for the cuts and plateaus, 1,000 for the rollback's
choice of weights; 128 samples a round, alpha 0.05, threshold 0.3. docs/STREAMS.md quotes these
numbers beside the rules."""

from __future__ import annotations

import numpy as np

from areal_metrics.streams.core.config import RunConfig
from tests import loop_simulation as sim


def test_the_loops_false_alarm_and_detection_rates() -> None:
    rates = sim.rates(runs=2000, seed=27)
    # a policy that never changes, at the threshold, over 20 rounds: at most alpha of runs cut
    assert rates["constant_cut"] <= 0.05
    # improving by 0.05 a round: at most 5 % of runs told that improvement stopped
    assert rates["improving_plateau"] <= 0.05
    # 0.5 -> 0.1 after 10 healthy rounds: at least 80 % of runs cut within two rounds ...
    assert rates["drop_cut_within_two"] >= 0.80
    # ... and the healthy rounds before the drop within alpha
    assert rates["drop_cut_before"] <= 0.05


def test_the_simulation_can_fail_a_rule_that_acts_on_the_point_estimate() -> None:
    # the same runs, with alpha so large that the interval shrinks to nearly the point: the
    # constant policy gets cut in most runs (what the issue measured on the old rule)
    loose = RunConfig(lr_eval_threshold=sim.THRESHOLD, lr_alpha=0.5, no_improvement_rounds=sim.PATIENCE)
    rng = np.random.default_rng(1)
    logs = [sim.run_once(sim.CONSTANT, rng, loose) for _ in range(200)]
    assert sim.share(logs, lambda log: bool(log.threshold_cuts)) > 0.05


def test_the_rollback_restores_good_rounds_and_not_bad_ones() -> None:
    rates = sim.rollback_rates(runs=1000, seed=40)
    # 0.5 -> 0.1: a cut (95 % of runs, above) names a round of the good stretch ...
    assert rates["collapse_restores_good"] >= 0.90 and rates["collapse_restores_bad"] == 0.0
    # ... and a slide through 0.25 (under the threshold 0.3, but close) hardly ever names that round
    assert rates["slide_restores_good"] >= 0.90 and rates["slide_restores_bad"] <= 0.05
    # the good round named is one the reference trainer still keeps (the slide puts it 2-4 rounds back)
    assert rates["slide_restores_kept"] >= 0.90 and rates["collapse_restores_kept"] >= 0.90


def test_the_simulation_can_fail_a_rollback_that_trusts_the_point_estimate(monkeypatch) -> None:
    from areal_metrics.streams.core import eval_loop

    monkeypatch.setattr(eval_loop, "shown_good", lambda c, threshold: c.accuracy >= threshold)
    assert sim.rollback_rates(runs=300, seed=41)["slide_restores_bad"] > 0.05
