"""The cross-node vote: order invariance, every majority/minority split, degraded mode."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.state import codec
from areal_metrics.streams.core.voting import (
    NodeResult,
    RoundKey,
    VoteOutcome,
    VoteState,
    add_result,
    combine,
    expire,
    quorum,
)

CFG = RunConfig()
KEY = RoundKey("run-a", "e1", "math500", "quick")


def feed(results: list[NodeResult], replicas: int, key: RoundKey = KEY, state: VoteState | None = None,
         now: float = 0.0) -> tuple[VoteState, list[VoteOutcome]]:
    state = state or VoteState()
    outcomes = []
    for r in results:
        state, outcome = add_result(state, key, 10, replicas, r, now, CFG)
        outcomes.append(outcome)
    return state, outcomes


def emitted(outcomes: list[VoteOutcome]):
    found = [o.consensus for o in outcomes if o.consensus is not None]
    assert len(found) <= 1, "more than one consensus for one round"
    return found[0] if found else None


def reference_majority(matrix: list[tuple[int, ...]]) -> dict[int, int]:
    """Sample -> its verdict, for the samples a strict majority decides (ties left out)."""
    n = len(matrix)
    return {i: int(sum(col) * 2 > n) for i, col in enumerate(zip(*matrix)) if sum(col) * 2 != n}


verdict_matrix = st.integers(1, 7).flatmap(
    lambda n: st.integers(1, 12).flatmap(
        lambda m: st.lists(st.lists(st.integers(0, 1), min_size=m, max_size=m).map(tuple), min_size=n, max_size=n)
    )
)


@settings(max_examples=300, deadline=None)
@given(verdict_matrix, st.randoms(use_true_random=False))
def test_verdict_vote_is_invariant_to_arrival_order(matrix: list[tuple[int, ...]], rnd: random.Random) -> None:
    replicas = len(matrix)
    results = [NodeResult(f"n{i}", True, sum(v) / len(v), 100.0, v) for i, v in enumerate(matrix)]
    accuracies = set()
    for _ in range(4):
        order = results[:]
        rnd.shuffle(order)
        _, outcomes = feed(order, replicas)
        c = emitted(outcomes)
        assert c is not None and not c.partial and not c.stale
        accuracies.add(c.accuracy)
    assert len(accuracies) == 1
    # ... and the accuracy is that of the per-sample majority of all replicas, over the decided
    # samples; a tie is undecided
    expected = reference_majority(matrix)
    assert accuracies == {sum(expected.values()) / len(expected) if expected else 0.0}
    assert (c.n_samples, c.n_undecided) == (len(expected), len(matrix[0]) - len(expected))
    assert c.ci_low <= c.accuracy <= c.ci_high


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 5, 6, 7])
def test_every_majority_minority_split(replicas: int) -> None:
    truth = (1, 0, 1, 1, 0, 0, 1, 0, 1, 1)
    wrong = tuple(1 - v for v in truth)
    for n_wrong in range(replicas + 1):
        nodes = [NodeResult(f"n{i}", True, None, 50.0, wrong if i < n_wrong else truth) for i in range(replicas)]
        for order in itertools.islice(itertools.permutations(nodes), 24):
            _, outcomes = feed(list(order), replicas)
            c = emitted(outcomes)
            assert c is not None
            counted = {r.node for r in order[: c.votes]}
            wrong_nodes = {f"n{i}" for i in range(n_wrong)}
            if n_wrong < quorum(replicas) and replicas - n_wrong >= quorum(replicas):
                # the correct side is a majority of the replicas: it wins, whatever the order
                assert c.accuracy == sum(truth) / len(truth)
                assert set(c.dissenters) == wrong_nodes & counted
            elif n_wrong >= quorum(replicas):
                assert c.accuracy == sum(wrong) / len(wrong)
                assert set(c.dissenters) == (set(f"n{i}" for i in range(replicas)) - wrong_nodes) & counted
            else:  # an exact tie: every sample undecided, nobody named
                assert c.votes == replicas and c.n_samples == 0 and c.n_undecided == len(truth)
                assert c.dissenters == () and (c.ci_low, c.ci_high) == (0.0, 1.0)
            assert 0.0 <= c.agreement <= 1.0


def test_emits_once_a_strict_majority_agrees_and_ignores_later_results() -> None:
    v = (1, 1, 0, 1)
    state, outcomes = feed([NodeResult("a", True, 0.75, 10.0, v), NodeResult("b", True, 0.75, 12.0, v)], 3)
    c = emitted(outcomes)
    assert c is not None and c.votes == 2 and c.replicas == 3 and c.dissenters == () and c.agreement == 1.0
    assert c.accuracy == 0.75 and c.response_length == 11.0
    assert outcomes[0].consensus is None
    state2, late = add_result(state, KEY, 10, 3, NodeResult("c", True, 0.0, 1.0, (0, 0, 0, 0)), 5.0, CFG)
    assert late == VoteOutcome() and state2 == state


def test_wrong_node_among_the_first_two_is_a_dissenter_and_diverges() -> None:
    truth = (1, 1, 0, 1, 0, 1, 1, 1, 0, 0)
    bad = (0, 0, 1, 0, 0, 1, 1, 1, 0, 0)
    _, outcomes = feed(
        [NodeResult("a", True, 0.6, 10.0, truth), NodeResult("bad", True, 0.4, 30.0, bad),
         NodeResult("c", True, 0.6, 12.0, truth)], 3)
    assert outcomes[0].consensus is None and outcomes[1].consensus is None
    c = outcomes[2].consensus
    assert c is not None and c.accuracy == 0.6 and c.dissenters == ("bad",) and c.votes == 3
    assert c.agreement == pytest.approx(1 - 4 / 30)
    assert c.response_length == 11.0  # the majority side's median
    kinds = [(a.kind, a.about) for a in outcomes[2].alerts]
    assert kinds == [("node_divergence", ("node_divergence", "run-a", "e1", "math500", "quick", "bad"))]


def test_redelivered_result_does_not_count_twice() -> None:
    v = (1, 0)
    a = NodeResult("a", True, 0.5, 1.0, v)
    _, outcomes = feed([a, a, a], 3)
    assert all(o.consensus is None for o in outcomes)


def test_values_vote_within_tolerance_and_median_fallback() -> None:
    state, outcomes = feed([NodeResult("a", True, 0.50), NodeResult("b", True, 0.51)], 3)
    c = emitted(outcomes)
    assert c is not None and c.accuracy == pytest.approx(0.505) and c.dissenters == ()

    _, outcomes = feed([NodeResult("a", True, 0.50), NodeResult("b", True, 0.70), NodeResult("c", True, 0.505)], 3)
    c = emitted(outcomes)
    assert c is not None and c.accuracy == pytest.approx(0.5025) and c.dissenters == ("b",)
    assert c.agreement == pytest.approx(2 / 3)
    assert [a.kind for a in outcomes[-1].alerts] == ["node_divergence"]

    _, outcomes = feed([NodeResult("a", True, 0.1), NodeResult("b", True, 0.5), NodeResult("c", True, 0.9)], 3)
    c = emitted(outcomes)
    assert c is not None and c.accuracy == 0.5 and c.dissenters == ()
    assert "vote_no_majority" in [a.kind for a in outcomes[-1].alerts]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=7), st.randoms(use_true_random=False))
def test_value_combination_is_order_invariant(values: list[float], rnd: random.Random) -> None:
    results = [NodeResult(f"n{i}", True, v) for i, v in enumerate(values)]
    first = combine(results, len(results), CFG)
    for _ in range(3):
        rnd.shuffle(results)
        assert combine(results, len(results), CFG) == first


def test_failed_round_repeats_last_good_as_stale_and_alerts() -> None:
    v = (1, 0, 1, 1)
    state, outcomes = feed([NodeResult(n, True, 0.75, 20.0, v) for n in "abc"], 3)
    good = emitted(outcomes)
    assert good is not None
    k2 = RoundKey("run-a", "e2", "math500", "quick")
    state, o1 = add_result(state, k2, 20, 3, NodeResult("a", False, error="OOM"), 1.0, CFG)
    assert o1 == VoteOutcome()  # two more could still make a quorum
    state, o2 = add_result(state, k2, 20, 3, NodeResult("b", False, error="timeout"), 1.0, CFG)
    stale = o2.consensus
    assert stale is not None and stale.stale and stale.key == k2 and stale.step == 20
    assert stale.accuracy == good.accuracy and stale.dissenters == good.dissenters
    assert [a.kind for a in o2.alerts] == ["eval_failed"]
    assert "a: OOM" in o2.alerts[0].message and "b: timeout" in o2.alerts[0].message
    # the third node's late ok result changes nothing
    state3, o3 = add_result(state, k2, 20, 3, NodeResult("c", True, 0.75, 20.0, v), 2.0, CFG)
    assert o3 == VoteOutcome() and state3 == state
    # the stale repeat did not become the "last good"
    assert state.last_good[("math500", "quick")] == good


def test_timeout_gives_partial_with_quorum_and_failure_without() -> None:
    cfg = RunConfig(vote_timeout_s=30)
    state = VoteState()
    k_tie = RoundKey("r", "e1", "d", "full")
    k_one = RoundKey("r", "e2", "d", "full")
    state, _ = add_result(state, k_tie, 1, 3, NodeResult("a", True, 0.5, None, (1, 0)), 0.0, cfg)
    state, _ = add_result(state, k_tie, 1, 3, NodeResult("b", True, 0.5, None, (0, 1)), 1.0, cfg)
    state, _ = add_result(state, k_one, 2, 3, NodeResult("a", True, 0.5, None, (1, 0)), 5.0, cfg)
    state, outcomes = expire(state, 29.9, cfg)
    assert outcomes == []
    state, outcomes = expire(state, 30.0, cfg)
    assert len(outcomes) == 1 and outcomes[0].consensus is not None
    tie = outcomes[0].consensus
    assert tie.partial and (tie.n_samples, tie.n_undecided) == (0, 2) and tie.dissenters == ()  # ties: undecided
    state, outcomes = expire(state, 35.0, cfg)
    assert len(outcomes) == 1 and outcomes[0].consensus is not None and outcomes[0].consensus.stale
    assert "no quorum within 30 s (1 of 3 nodes answered ok, 2 needed)" in outcomes[0].alerts[0].message
    assert state.open_rounds == {} and k_one in state.closed


def test_failed_round_without_earlier_result_only_alerts() -> None:
    _, outcomes = feed([NodeResult("a", False, error="crash")], 1)
    assert outcomes[0].consensus is None
    assert [a.kind for a in outcomes[0].alerts] == ["eval_failed"]
    assert "no earlier result to repeat" in outcomes[0].alerts[0].message


def test_vote_state_round_trips() -> None:
    state, _ = feed([NodeResult("a", True, 0.5, 3.0, (1, 0))], 3)
    state, _ = feed([NodeResult(n, True, 0.5, 3.0, (1, 0)) for n in "ab"], 2,
                    key=RoundKey("run-a", "e9", "aime", "full"), state=state)
    assert codec.loads(VoteState, codec.dumps(state)) == state
