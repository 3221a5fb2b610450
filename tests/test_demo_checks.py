"""The demo's checks (areal_metrics.commands.demo_sql) pass on what is right and fail on what is not:
the real embedded store, holding the recorded workload and rounds built to be right or wrong."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_metrics.commands.demo_sql import (above_threshold_check, checks, not_below_check, scale_lr_evidence,
                                             vote_check, vote_checks)
from areal_metrics.producers.contract.events import Event
from areal_metrics.sinks.query import DirectStore
from tests.test_compare import _event
from tests.test_grafana_data import loaded_store
from tests.test_report import STRATEGY_RUNS, recorded

HONEST = [1, 0, 1, 1, 0, 0, 1, 0] * 4  # 32 samples, accuracy 0.5


def faulty_run(run: str, consensus: float, dissenters: list[str]) -> list[Event]:
    """Three nodes evaluate every sample; node -r1 flips every fourth verdict; the consensus as given."""
    events = [_event("run", run, "h-r0", status="running", group="vote", world_size=3, config={"dissent_rank": 1})]
    eval_id = f"{run}:5:math:full"
    for rank in range(3):
        verdicts = [1 - v if rank == 1 and i % 4 == 0 else v for i, v in enumerate(HONEST)]
        events.append(_event("eval", run, f"h-r{rank}", eval_id=eval_id, step=5, dataset="math", stage="full",
                             accuracy=sum(verdicts) / 32, n_samples=32, replicas=3, verdicts=verdicts,
                             dataset_fingerprint="fp"))
    events.append(_event("eval_consensus", run, "worker", eval_id=eval_id, step=5, dataset="math", stage="full",
                         accuracy=consensus, votes=3, replicas=3, agreement=0.9, dissenters=dissenters))
    return events


def regression_run(run: str, levels: dict[int, int], cut_from: int | None = 10, restore: int | None = 0,
                   intervals: bool = True) -> list[Event]:
    """A regression run on 64 prompts, 2 nodes agreeing: at each step the first `levels[step]` prompts
    right; a scale_lr that restores `restore` from `cut_from`; its loop watches math at threshold 0.1;
    `intervals` False: the consensus carries no interval (the check takes Wilson's from its n_samples)."""
    events = [_event("run", run, "h-r0", status="running", group="lr-regression", world_size=2,
                     config={"eval_loop": {"enabled": True, "dataset": "math", "threshold": 0.10}})]
    for step, right in levels.items():
        verdicts = [int(i < right) for i in range(64)]
        eval_id = f"{run}:{step}:math:full"
        for node in ("h-r0", "h-r1"):
            events.append(_event("eval", run, node, eval_id=eval_id, step=step, dataset="math", stage="full",
                                 accuracy=right / 64, n_samples=64, replicas=2, verdicts=verdicts,
                                 dataset_fingerprint="fp"))
        p, half = right / 64, 1.96 * (right / 64 * (1 - right / 64) / 64) ** 0.5
        interval = {"ci_low": max(0.0, p - half), "ci_high": min(1.0, p + half)} if intervals else {}
        events.append(_event("eval_consensus", run, "worker", eval_id=eval_id, step=step, dataset="math", stage="full",
                             accuracy=p, votes=2, replicas=2, agreement=1.0, dissenters=[], n_samples=64, **interval))
    args = {"factor": 0.1, **({"from_step": cut_from} if cut_from is not None else {}),
            **({"restore_step": restore} if restore is not None else {})}
    events.append(_event("command", run, "worker", command="scale_lr", args=args, reason="a cut"))
    return events


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectStore]:
    built = (faulty_run("vote-right", 0.5, ["h-r1"]) + faulty_run("vote-tie-as-0", 0.375, ["h-r1"])
             + faulty_run("vote-blames-honest", 0.5, ["h-r1", "h-r2"])
             + regression_run("back-x-lr-high", {0: 20, 8: 2, 16: 21, 24: 19, 32: 15})  # back, drifting, above
             + regression_run("lost-x-lr-high", {0: 20, 8: 2, 16: 6, 24: 7})  # the rollback did not bring it back
             + regression_run("under-x-lr-high", {0: 20, 8: 2, 16: 19, 24: 1})  # back, then shown below the threshold
             + regression_run("none-x-lr-high", {0: 20, 8: 2, 16: 20}, restore=None)  # a cut without a rollback
             + regression_run("nofrom-x-lr-high", {0: 20, 8: 2, 16: 20}, cut_from=None)  # no step to look after
             + regression_run("gap-x-lr-high", {0: 20, 8: 2, 16: 20}, restore=4)  # no round of the restored step
             + regression_run("early-x-lr-high", {0: 20, 8: 2})  # no round after the restore
             + regression_run("nullci-x-lr-high", {0: 20, 8: 2, 16: 19, 24: 1}, intervals=False))
    with loaded_store(tmp_path_factory.mktemp("demo-checks"), recorded() + built) as opened:
        yield opened


def test_scale_lr_needs_evidence_that_supports_it() -> None:
    # the reasons the loop itself writes (a cut, a raise, a plateau cut) read as evidence
    from areal_metrics.streams.core.config import RunConfig
    from areal_metrics.streams.core.eval_loop import EvalLoopState, on_consensus
    from tests.test_streams_eval_loop import cons

    cfg = RunConfig(lr_eval_threshold=0.5, no_improvement_rounds=0)
    state, reasons = EvalLoopState(), []
    for step, acc in ((10, 0.7), (20, 0.1), (30, 0.8), (40, 0.8), (50, 0.8)):
        state, _, commands = on_consensus(state, cons(step, acc), cfg)
        reasons += [c.reason for c in commands]
    assert len(reasons) == 2 and all(scale_lr_evidence(r)[0] for r in reasons)
    plateau_cfg = RunConfig(lr_eval_threshold=0.05, no_improvement_rounds=3)
    state = EvalLoopState()
    for i, acc in enumerate([0.300, 0.301, 0.299, 0.300, 0.300, 0.301, 0.300]):
        state, _, commands = on_consensus(state, cons(10 * i, acc, n=20000), plateau_cfg)
        reasons += [c.reason for c in commands]
    assert len(reasons) == 3 and scale_lr_evidence(reasons[-1])[0]
    # and what does not support its action does not
    cut = reasons[0]
    statistic = cut.split("shortfall ")[1].split(" ")[0]
    assert not scale_lr_evidence(cut.replace(f"shortfall {statistic} > limit", "shortfall 0.1 <= limit"))[0]
    assert not scale_lr_evidence("evaluation math_hard accuracy 0.09 fell below threshold 0.12")[0]  # a point estimate


def test_scale_lr_on_evidence_fails_with_no_command_and_when_the_regression_run_got_none(store: DirectStore) -> None:
    # 0 of 0 is not a pass: runs with no scale_lr at all, among them a regression run
    [scale] = [(passed, what) for passed, what in checks(store, ["vote-right", "demo-x-lr-high"])
               if what.startswith("scale_lr on evidence")]
    assert not scale[0] and "0 of 0" in scale[1] and "the regression run demo-x-lr-high got no scale_lr" in scale[1]


def test_a_round_is_below_another_only_when_the_paired_sign_test_says_so() -> None:
    import random

    from scipy.stats import binomtest

    rng = random.Random(7)
    first = {s: int(rng.random() < 0.3) for s in range(512)}
    same = not_below_check("math", (16, first), (40, dict(first)))
    assert same[0] and "0 lost, 0 gained" in same[1]
    # 40 prompts lost and 10 gained: the paired test (scipy's exact binomial, two-sided) says it fell
    right = [s for s in first if first[s]][:40]
    wrong = [s for s in first if not first[s]][:10]
    fell = {**first, **{s: 0 for s in right}, **{s: 1 for s in wrong}}
    passed, what = not_below_check("math", (16, first), (40, fell))
    assert not passed and "40 lost, 10 gained" in what and "significantly below" in what
    assert binomtest(10, 50).pvalue < 0.05
    # a few lost, about as many gained: noise of the same size is not below
    assert not_below_check("math", (16, first), (40, {**first, **{s: 0 for s in right[:6]},
                                                      **{s: 1 for s in wrong[:4]}}))[0]
    assert not not_below_check("math", (16, {0: 1}), (40, {1: 1}))[0]  # nothing to compare is not a pass


def test_the_rollback_check_pairs_prompts_as_compare_does_not_their_samples() -> None:
    """32 prompts of 4 samples, all right; then 3 prompts lose all 4. Paired by sample (12 lost, 0 gained)
    the demo called it significantly below; by prompt, the unit `compare` pairs (3 lost), it is not."""
    from scipy.stats import binomtest

    from areal_metrics.analysis.comparison import prompt_scores

    before = {s: 1 for s in range(128)}
    after = {**before, **{s: 0 for s in range(12)}}
    passed, what = not_below_check("math", (16, before), (40, after), samples_per_prompt=4)
    assert passed and "over 32 prompts (3 lost, 0 gained" in what
    assert f"sign test p = {binomtest(0, 3).pvalue:.3f})" in what
    assert prompt_scores({0: 1, 1: 0, 2: 1, 5: 1}, 4) == {0: 2 / 3, 1: 1.0}
    assert not not_below_check("math", (16, before), (40, after), samples_per_prompt=1)[0]  # one sample a prompt


def test_above_the_threshold_fails_on_a_round_shown_below_it_and_prints_the_drift_as_a_measurement() -> None:
    held = above_threshold_check("r-lr-high", "math", 0.10, [(16, 0.164, 0.199), (40, 0.131, 0.165)], "math fell")
    assert held[0] and "the lowest 0.131 at step 40" in held[1] and "a measurement, not a check: " in held[1]
    shown_below = above_threshold_check("r-lr-high", "math", 0.10, [(16, 0.164, 0.199), (24, 0.06, 0.09)], "")
    assert not shown_below[0] and "NOT: step 24 shown below it" in shown_below[1]
    # a point estimate under the threshold whose interval reaches above it is not evidence
    assert above_threshold_check("r-lr-high", "math", 0.10, [(16, 0.09, 0.13)], "")[0]
    assert not above_threshold_check("r-lr-high", None, 0.10, [(16, 0.2, 0.3)], "")[0]  # no loop: not a pass
    assert not above_threshold_check("r-lr-high", "math", 0.10, [], "")[0]  # no round after it: not a pass


def test_the_regression_checks_on_the_store(store: DirectStore) -> None:
    results = {what.split(" ")[0].rstrip(":") + ("/back" if "brought" in what else "/above"): (passed, what)
               for passed, what in checks(store, ["back-x-lr-high", "lost-x-lr-high", "under-x-lr-high",
                                                 "none-x-lr-high"]) if "rollback" in what}
    assert {k: v[0] for k, v in results.items()} == {
        "back-x-lr-high/back": True, "back-x-lr-high/above": True, "lost-x-lr-high/back": False,
        "lost-x-lr-high/above": True, "under-x-lr-high/back": True, "under-x-lr-high/above": False,
        "none-x-lr-high/back": False}
    assert "math 0.312 at step 0 -> 0.328 at step 16 over 64 prompts (0 lost, 1 gained" in results["back-x-lr-high/back"][1]
    assert "0.328 at step 16 -> 0.234 at step 32" in results["back-x-lr-high/above"][1]  # the drift, printed
    assert "14 lost, 0 gained" in results["lost-x-lr-high/back"][1] and "NOT: below it" in results["lost-x-lr-high/back"][1]
    assert "NOT: step 24 shown below it" in results["under-x-lr-high/above"][1]
    assert "no scale_lr restored weights" in results["none-x-lr-high/back"][1]


def test_the_regression_checks_are_not_passed_by_what_is_missing(store: DirectStore) -> None:
    runs = ["nofrom-x-lr-high", "gap-x-lr-high", "early-x-lr-high", "nullci-x-lr-high"]
    results = {what.split(" ")[0].rstrip(":") + ("/back" if "brought" in what else "/above"): (passed, what)
               for passed, what in checks(store, runs) if "rollback" in what}
    assert {k: v[0] for k, v in results.items()} == {
        "nofrom-x-lr-high/back": False, "gap-x-lr-high/back": False, "early-x-lr-high/back": False,
        "nullci-x-lr-high/back": True, "nullci-x-lr-high/above": False}
    assert "(with its from_step)" in results["nofrom-x-lr-high/back"][1]
    assert "no full round of the restored step and one after it" in results["gap-x-lr-high/back"][1]
    assert "no full round of the restored step and one after it" in results["early-x-lr-high/back"][1]
    # no interval on the consensus: Wilson's from its 64 samples, 1 right: upper end 0.083 < 0.1
    from areal_metrics.producers.contract.statistics import wilson

    upper = wilson(1 / 64, 64)[1]
    assert upper < 0.1 and f"upper end {upper:.3f}" in results["nullci-x-lr-high/above"][1]
    assert "NOT: step 24 shown below it" in results["nullci-x-lr-high/above"][1]


def test_a_regression_run_without_a_rollback_is_not_a_pass(store: DirectStore) -> None:
    [back] = [(passed, what) for passed, what in checks(store, ["vote-right", "demo-x-lr-high"])
              if "rollback" in what]
    assert not back[0] and "no scale_lr restored weights" in back[1]


def test_a_vote_check_fails_on_a_tie_counted_as_wrong_and_on_a_blamed_honest_node() -> None:
    nodes = {"a-r0": {0: 1, 1: 1, 2: 0, 3: 1}, "a-r1": {0: 0, 1: 1, 2: 0, 3: 1}}  # sample 0 a tie
    assert vote_check(2 / 3, ["a-r1"], nodes, "a-r1")[0]  # 3 decided samples, 2 right
    passed, what = vote_check(0.5, [], nodes, None)  # the tie counted as a wrong answer
    assert not passed and "!= vote 0.6667" in what


def test_vote_checks_on_the_store(store: DirectStore) -> None:
    results = dict((what.split(" ")[0], passed) for passed, what in
                   vote_checks(store, ["vote-right", "vote-tie-as-0", "vote-blames-honest"]))
    assert results == {"vote-right": True, "vote-tie-as-0": False, "vote-blames-honest": False}


def test_the_recorded_workload_fails_only_on_its_point_estimate_lr_cuts(store: DirectStore) -> None:
    """Recorded before the loop acted on evidence: its scale_lr reasons cite a point estimate only."""
    results = checks(store, list(STRATEGY_RUNS))
    failed = [what for passed, what in results if not passed]
    assert len(failed) == 1 and failed[0].startswith("scale_lr on evidence: 0 of 7")
    assert "below threshold 0.5" in failed[0]
    assert sum("per-sample vote" in what for _, what in results) == len(STRATEGY_RUNS)


def test_the_learning_table_reads_rise_and_slope_t_and_says_whether_the_goal_is_met() -> None:
    from areal_metrics.commands.demo_sql import learning_rows

    rising = [(8 * i, 0.20 + 0.04 * i + (0.005 if i % 2 else -0.005), 0.0, 0.06) for i in range(6)]  # SE ~0.015
    flat = [(8 * i, 0.25 + (0.02 if i % 2 else -0.02), 0.2, 0.3) for i in range(6)]
    short = rising[:4]
    rows = {(r[0], r[1]): r for r in learning_rows([("a", "math_id", rising), ("b", "math_id", flat),
                                                    ("c", "math_id", short)])}
    assert rows[("a", "math_id")][3:5] == ("0.195 -> 0.405", "+0.210") and float(rows[("a", "math_id")][5]) > 3
    assert rows[("a", "math_id")][6] == "yes"
    assert rows[("b", "math_id")][6] == "no" and abs(float(rows[("b", "math_id")][5])) < 3
    assert rows[("c", "math_id")][2] == 4 and rows[("c", "math_id")][6] == "no"  # fewer than 5 rounds


def test_a_sharded_vote_with_a_stuck_grader_is_the_honest_one_and_names_only_the_stuck_rank() -> None:
    # 3 ranks at 2 replicas (blocks r and r+1), rank 1's grader returns 0 for everything, rank r adjudicating
    # the disputed samples of block r + 2: what the demo's vote run publishes
    from areal_metrics.areal_train.evaluation import _flipped

    truth = {s: int(s % 3 != 0) for s in range(30)}  # 3 blocks of 10 samples
    blocks = [range(0, 10), range(10, 20), range(20, 30)]
    nodes: dict[str, dict[int, int]] = {}
    for rank in range(3):
        held = [s for b in (blocks[rank], blocks[(rank + 1) % 3]) for s in b]
        verdicts = [truth[s] for s in held]
        if rank == 1:
            verdicts = list(_flipped(verdicts, "stuck"))
        nodes[f"v-r{rank}"] = dict(zip(held, verdicts))
    for rank in range(3):  # adjudication: the samples of block r + 2 its two holders dispute
        block = blocks[(rank + 2) % 3]
        holders = [n for n in nodes if n != f"v-r{rank}"]
        disputed = [s for s in block if len({nodes[h][s] for h in holders if s in nodes[h]}) > 1]
        nodes[f"v-r{rank}"].update({s: 0 if rank == 1 else truth[s] for s in disputed})
    honest_accuracy = sum(truth.values()) / 30
    passed, what = vote_check(honest_accuracy, ["v-r1"], nodes, "v-r1")
    assert passed, what
    assert not vote_check(honest_accuracy, ["v-r1", "v-r0"], nodes, "v-r1")[0]  # an honest rank blamed
