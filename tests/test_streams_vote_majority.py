"""The vote with a real majority (CONTRACT.md, "Evaluation you can trust"), pure: ties are
undecided, only outvoted nodes are named, sharding from sample_ids/shard_nodes, an
adjudicating third vote, rank-0-only logging, and the consensus interval's coverage."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.producers.contract.events import EvalEvent, RunEvent, parse_event
from areal_metrics.producers.contract.field_rules import ValidationError
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.processor import RunState, on_eval, on_run, on_tick
from areal_metrics.producers.contract.statistics import bounded_interval, clusters_of, proportion_interval, wilson
from areal_metrics.streams.core.voting import NodeResult, RoundKey, VoteState, add_result, combine

CFG = RunConfig()
KEY = RoundKey("run-v", "e1", "math500", "full")


def vote(results: list[NodeResult], replicas: int, shard_nodes: int | None = None):
    state, found, alerts = VoteState(), [], []
    for r in results:
        state, outcome = add_result(state, KEY, 10, replicas, r, 0.0, CFG, shard_nodes)
        if outcome.consensus is not None:
            found.append(outcome.consensus)
        alerts += outcome.alerts
    assert len(found) <= 1
    return (found[0] if found else None), alerts


def test_two_replicas_disagreeing_leave_those_samples_undecided_and_name_nobody() -> None:
    # the case: 100 samples, 60 correct; one replica misses 40 % of the correct ones
    truth = [1] * 60 + [0] * 40
    honest = NodeResult("honest", True, 0.6, 10.0, tuple(truth))
    flaky = tuple(0 if i < 24 else v for i, v in enumerate(truth))  # 24 of the 60 correct marked wrong
    c, alerts = vote([honest, NodeResult("flaky", True, 0.36, 10.0, flaky)], 2)
    assert c is not None and (c.n_samples, c.n_undecided) == (76, 24)
    # `accuracy` is the mean over the decided samples (biased: 0.474 against a truth of 0.60), so no
    # decision reads it alone: the interval bounds the accuracy over all 100, undecided both ways
    assert c.accuracy == pytest.approx(36 / 76)
    assert c.ci_low <= 36 / 100 and c.ci_high >= 60 / 100  # the truth 0.60 is inside, and so is 0.36
    assert (c.ci_low, c.ci_high) == pytest.approx(
        bounded_interval({s: [v] for s, v in enumerate(truth) if s >= 24}, {s: 1 for s in range(24)}))
    assert c.dissenters == ()  # who is right cannot be told at two replicas
    [alert] = alerts
    assert (alert.kind, alert.severity, alert.value) == ("vote_undecided", "warning", pytest.approx(0.24))
    assert "flaky and honest disagree on 24 of 100" in alert.message
    assert "two replicas cannot tell which one is wrong" in alert.message and "third replica" in alert.message


def test_an_undecided_share_at_or_below_the_setting_raises_no_alert() -> None:
    truth = [1] * 60 + [0] * 40
    flaky = tuple(0 if i < 5 else v for i, v in enumerate(truth))  # 5 % undecided: not above 0.05
    c, alerts = vote([NodeResult("a", True, None, None, tuple(truth)), NodeResult("b", True, None, None, flaky)], 2)
    assert c is not None and c.n_undecided == 5 and alerts == []
    cfg = RunConfig(vote_undecided_alert=0.04)
    _, outcome = add_result(VoteState(), KEY, 10, 2, NodeResult("a", True, None, None, tuple(truth)), 0.0, cfg)
    _, outcome = add_result(_, KEY, 10, 2, NodeResult("b", True, None, None, flaky), 0.0, cfg)
    assert [a.kind for a in outcome.alerts] == ["vote_undecided"]


def faulty_round(world: int, redundancy: int, n: int, faulty: int, rnd: random.Random):
    truth = [rnd.randint(0, 1) for _ in range(n)]
    results = []
    for node in range(world):
        ids = [s for s in range(n) if (s - node) % world < redundancy]  # each sample on `redundancy` nodes
        verdicts = tuple(1 - truth[s] if node == faulty and s % 2 == 0 else truth[s] for s in ids)
        results.append(NodeResult(f"n{node}", True, None, 5.0, verdicts, sample_ids=tuple(ids)))
    return truth, results


@settings(max_examples=150, deadline=None)
@given(st.integers(3, 6), st.integers(0, 5), st.randoms(use_true_random=False))
def test_one_faulty_node_never_moves_the_consensus_and_only_it_is_named(world: int, faulty: int,
                                                                        rnd: random.Random) -> None:
    faulty %= world
    truth, results = faulty_round(world, 3, 24, faulty, rnd)
    rnd.shuffle(results)
    c, alerts = vote(results, 3, world)
    assert c is not None and c.accuracy == sum(truth) / len(truth) and c.n_undecided == 0
    assert set(c.dissenters) <= {f"n{faulty}"}
    assert {a.about[-1] for a in alerts if a.kind == "node_divergence"} <= {f"n{faulty}"}
    if results[0].node == f"n{faulty}":  # counted from the start: it is outvoted and named
        assert c.dissenters == (f"n{faulty}",)


def test_four_ranks_at_redundancy_three_with_a_faulty_evaluator() -> None:
    truth, results = faulty_round(4, 3, 128, 2, random.Random(3))
    results.sort(key=lambda r: r.node != "n2")  # the faulty one first
    c, alerts = vote(results, 3, 4)
    assert c.accuracy == sum(truth) / 128 and c.dissenters == ("n2",) and c.votes == 4
    assert [a.about[-1] for a in alerts if a.kind == "node_divergence"] == ["n2"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1), min_size=6, max_size=6), min_size=1, max_size=6))
def test_a_node_is_named_only_where_a_strict_majority_outvoted_it(matrix: list[list[int]]) -> None:
    results = [NodeResult(f"n{i}", True, None, None, tuple(v)) for i, v in enumerate(matrix)]
    comb = combine(results, len(matrix), CFG)
    n, need = len(matrix), len(matrix) // 2 + 1
    decided = {}  # sample -> the side a strict majority of the replicas took
    for s in range(6):
        ones = sum(m[s] for m in matrix)
        if max(ones, n - ones) >= need and ones * 2 != n:
            decided[s] = int(ones * 2 > n)
    for r in results:
        outvoted = [s for s, side in decided.items() if r.verdicts[s] != side]
        assert (r.node in comb.dissenters) == bool(outvoted)
    assert comb.n_samples + comb.n_undecided == 6


def test_an_adjudicating_third_vote_decides_a_disputed_sample() -> None:
    # 2 replicas: n0 and n1 hold samples 0..3 and disagree on sample 1; n2 adjudicates it
    n0 = NodeResult("n0", True, None, None, (1, 1, 0, 1), sample_ids=(0, 1, 2, 3))
    n1 = NodeResult("n1", True, None, None, (1, 0, 0, 1), sample_ids=(0, 1, 2, 3))
    n2 = NodeResult("n2", True, None, None, (0,), sample_ids=(1,))
    c, _ = vote([n0, n1], 2, 3)
    assert c is None  # sample 1 is open and the adjudicator may still come
    c, alerts = vote([n0, n1, n2], 2, 3)
    assert (c.n_samples, c.n_undecided, c.accuracy, c.dissenters) == (4, 0, 0.5, ("n0",))


def test_a_round_whose_every_sample_agrees_closes_before_the_last_node() -> None:
    n0 = NodeResult("n0", True, None, None, (1, 0), sample_ids=(0, 1))
    n1 = NodeResult("n1", True, None, None, (1, 0), sample_ids=(0, 1))
    c, _ = vote([n0, n1], 2, 3)
    assert c is not None and (c.n_samples, c.votes) == (2, 2)


def run_event(rank: int, world: int) -> RunEvent:
    return RunEvent(run_id="run-v", node=f"host-{rank}", rank=rank, status="running", world_size=world, ts=1.0,
                    event_id=f"run-{rank}")


def eval_event(node: str, rank: int, replicas: int) -> EvalEvent:
    return EvalEvent(run_id="run-v", node=node, rank=rank, eval_id="e1", step=5, dataset="math500",
                     accuracy=0.75, verdicts=(1, 1, 0, 1), replicas=replicas, ts=2.0, event_id=f"ev-{node}")


def test_rank_zero_only_logging_gets_its_consensus_and_no_eval_failed() -> None:
    cfg = RunConfig(vote_timeout_s=60, step_wait_s=30)
    state, _ = on_run(RunState("run-v"), run_event(0, 2), 0.0, cfg)  # rank 1 never calls init
    # a round long after the run started: rank 1 is not waited for (the client says replicas 2)
    later, out = on_eval(state, eval_event("host-0", 0, replicas=2), 100.0, cfg)
    [consensus] = [o.event for o in out if o.event.type == "eval_consensus"]
    assert (consensus.votes, consensus.replicas, consensus.accuracy, consensus.partial) == (1, 1, 0.75, False)
    later, out = on_tick(later, 1000.0, cfg)
    assert [o.event.kind for o in out if o.event.type == "alert"] == []
    # a round right after the start (rank 1's `running` could still be on its way): at the timeout,
    # with rank 0 alone registered, the consensus of rank 0, not partial, and no eval_failed
    state, out = on_eval(state, eval_event("host-0", 0, replicas=2), 1.0, cfg)
    assert out == []
    state, out = on_tick(state, 61.0, cfg)
    kinds = [(o.event.type, getattr(o.event, "kind", None)) for o in out]
    assert kinds == [("eval_consensus", None)] and (out[0].event.replicas, out[0].event.partial) == (1, False)


def test_a_round_every_registered_rank_answered_closes_at_the_tick_that_trusts_the_count() -> None:
    """Issue 40, item 12: rank 0 alone logs a 2-rank run and evaluates right at the start (the first
    evaluation of the run): the round closes at the first tick once the count of registered ranks
    has held for step_wait_s, not at vote_timeout_s."""
    from areal_metrics.streams.core.processor import has_clock_work

    cfg = RunConfig(vote_timeout_s=120, step_wait_s=3)
    state, _ = on_run(RunState("run-v"), run_event(0, 2), 10.0, cfg)
    state, out = on_eval(state, eval_event("host-0", 0, replicas=2), 10.5, cfg)
    assert out == []  # one registered rank, but that count is 0.5 s old: rank 1's `running` may be on its way
    assert not has_clock_work(state, 12.0, cfg)
    state, out = on_tick(state, 12.0, cfg)
    assert out == []
    assert has_clock_work(state, 13.0, cfg)  # the count has held for step_wait_s: the tick re-checks the round
    state, out = on_tick(state, 13.0, cfg)
    [c] = [o.event for o in out if o.event.type == "eval_consensus"]
    assert (c.votes, c.replicas, c.accuracy, c.partial) == (1, 1, 0.75, False)
    assert [o for o in out if o.event.type == "alert"] == [] and not state.votes.open_rounds
    assert not has_clock_work(state, 200.0, cfg)
    state, out = on_tick(state, 200.0, cfg)  # the timeout finds nothing left to close or fail
    assert out == []


def test_a_registered_rank_that_does_not_answer_is_still_waited_for() -> None:
    cfg = RunConfig(vote_timeout_s=30)
    state = RunState("run-v")
    for rank in (0, 1):
        state, _ = on_run(state, run_event(rank, 2), 0.0, cfg)
    state, out = on_eval(state, eval_event("host-0", 0, replicas=2), 1.0, cfg)
    assert out == []
    state, out = on_tick(state, 1000.0, cfg)
    assert [o.event.kind for o in out if o.event.type == "alert"] == ["eval_failed"]


def test_sharding_fields_are_checked_and_named() -> None:
    base = dict(run_id="r", eval_id="e", step=1, dataset="d", accuracy=0.5, verdicts=[1, 0])
    cases = [
        (dict(sample_ids=[0]), "evals.sample_ids", "has 1 entries but there are 2 verdicts"),
        (dict(sample_ids=[3, 3]), "evals.sample_ids", "more than once"),
        (dict(sample_ids=[0, -1]), "evals.sample_ids[1]", "must be >= 0"),
        (dict(sample_ids=[0, 1.5]), "evals.sample_ids[1]", "not an integer (float)"),
        (dict(replicas=3, shard_nodes=2), "evals.shard_nodes", "fewer than replicas"),
        (dict(shard_nodes=0), "evals.shard_nodes", ">= 1"),
    ]
    for extra, field, words in cases:
        with pytest.raises(ValidationError) as err:
            parse_event(json.dumps(EvalEvent(**base).to_dict() | extra))
        assert str(err.value).startswith(field) and words in str(err.value), (extra, str(err.value))
    ok = parse_event(json.dumps(EvalEvent(**base).to_dict() | {"sample_ids": [9, 4], "shard_nodes": 4, "replicas": 3}))
    assert ok.sample_ids == (9, 4) and ok.shard_nodes == 4
    with pytest.raises(ValidationError, match=r"evals.verdicts\[0\]: must be <= 1"):  # verdicts stay 0/1
        parse_event(json.dumps(EvalEvent(**base).to_dict() | {"verdicts": [2, 0]}))


def test_the_interval_covers_the_accuracy_when_samples_cluster_by_prompt() -> None:
    """Seeded: 32 prompts x 4 samples whose solve rates spread around 0.4 (fresh prompts per
    round). The cluster-robust interval covers the mean about 95 % of the time; the plain
    Wilson interval on 128 samples, blind to the clustering, covers it less often."""
    rng = np.random.default_rng(11)
    trials, mean, hit_robust, hit_plain = 2000, 0.4, 0, 0
    for _ in range(trials):
        p = np.clip(mean + rng.normal(0, 0.2, 32), 0, 1)
        v = (rng.random((32, 4)) < p[:, None]).astype(int)
        acc = v.mean()
        low, high = proportion_interval({i: list(v[i]) for i in range(32)})
        hit_robust += low <= mean <= high
        low, high = wilson(acc, 128)
        hit_plain += low <= mean <= high
    assert hit_robust / trials >= 0.93
    assert hit_plain / trials < 0.92  # why the clustering is accounted for


def test_the_interval_on_the_consensus_event() -> None:
    state = RunState("run-v")
    verdicts = tuple([1, 1, 0, 0] * 32)
    ev = EvalEvent(run_id="run-v", node="n0", eval_id="e1", step=5, dataset="math500", accuracy=0.5,
                   verdicts=verdicts, replicas=1, metrics={"samples_per_prompt": 4.0}, ts=2.0, event_id="x")
    _, out = on_eval(state, ev, 1.0, CFG)
    c = out[0].event
    # every prompt 2 of 4: no spread between prompts, effective size 128 (Clopper-Pearson on the prompts' df)
    assert (c.n_samples, c.n_undecided) == (128, 0)
    assert (c.ci_low, c.ci_high) == pytest.approx(proportion_interval(clusters_of(verdicts, 4)))
    assert c.ci_high - c.ci_low >= wilson(0.5, 128)[1] - wilson(0.5, 128)[0]
    clustered = tuple([1, 1, 1, 1, 0, 0, 0, 0] * 16)  # prompts all right or all wrong: 32 prompts' worth
    _, out = on_eval(state, ev.replace(verdicts=clustered, event_id="y"), 1.0, CFG)
    c = out[0].event
    assert c.ci_high - c.ci_low > 1.5 * (wilson(0.5, 128)[1] - wilson(0.5, 128)[0])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.lists(st.lists(st.sampled_from([0, 1, None]), min_size=8, max_size=8),
                                   min_size=1, max_size=5))
def test_compare_decides_exactly_the_samples_the_worker_decides(replicas: int, matrix: list[list[int | None]]) -> None:
    """One majority rule (issue 43, item 1): compare's per-sample verdicts (statistics.node_majority at
    the consensus's replicas, what areal_metrics.analysis.comparison reads) are the worker's vote's, including
    samples with fewer votes than replicas (None: the node did not evaluate the sample)."""
    from areal_metrics.producers.contract.statistics import node_majority

    nodes = [{s: v for s, v in enumerate(row) if v is not None} for row in matrix]
    results = [NodeResult(f"n{i}", True, None, None, tuple(d.values()), sample_ids=tuple(d)) for i, d in enumerate(nodes)]
    results = [r for r in results if r.verdicts]
    if not results:
        return
    worker = combine(results, replicas, CFG, max(len(results), replicas)).verdicts
    assert node_majority(nodes, replicas) == dict(worker)
