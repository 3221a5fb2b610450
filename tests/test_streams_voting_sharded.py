"""The per-sample vote of a sharded round: windows laid out by areal_train, voted by streams.

Each node evaluates a cyclic window of the round's samples (areal_metrics.areal_train.evalsets.layout)
and publishes them as `sample_ids`, with `shard_nodes` and `replicas` (the contract's fields);
the worker votes each sample among the nodes that cover it.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.areal_train.evalsets import covered, layout
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.voting import NodeResult, RoundKey, VoteState, add_result

CFG = RunConfig()
KEY = RoundKey("run-a", "run-a:10:math_id:full", "math_id", "full")


def node_results(truth: list[int], n_prompts: int, k: int, world: int, redundancy: int,
                 flips: dict[int, set[int]] | None = None) -> list[NodeResult]:
    """What each rank reports for its window; `flips`: rank -> sample indices it gets wrong."""
    out = []
    for rank in range(world):
        shard = layout(n_prompts, k, world, redundancy, rank)
        samples = covered(shard, k)
        bad = (flips or {}).get(rank, set())
        verdicts = tuple(1 - truth[s] if s in bad else truth[s] for s in samples)
        out.append(NodeResult(node=f"n{rank}", ok=True, accuracy=sum(verdicts) / max(len(verdicts), 1),
                              response_length=10.0, verdicts=verdicts, sample_ids=tuple(samples)))
    return out


def vote(results: list[NodeResult], world: int, redundancy: int):
    state, found = VoteState(), []
    for r in results:
        state, outcome = add_result(state, KEY, 10, redundancy, r, 0.0, CFG, shard_nodes=world)
        if outcome.consensus is not None:
            found.append(outcome.consensus)
    assert len(found) == 1, "one consensus per round"
    return found[0]


@settings(max_examples=200, deadline=None)
@given(world=st.integers(1, 6), data=st.data())
def test_honest_shards_rebuild_every_sample_in_any_arrival_order(world: int, data) -> None:
    redundancy = data.draw(st.integers(1, world))
    n_prompts = data.draw(st.integers(world, 20))
    k = data.draw(st.integers(1, 4))
    truth = data.draw(st.lists(st.integers(0, 1), min_size=n_prompts * k, max_size=n_prompts * k))
    results = node_results(truth, n_prompts, k, world, redundancy)
    random.Random(data.draw(st.integers(0, 99))).shuffle(results)
    consensus = vote(results, world, redundancy)
    if redundancy == 2:  # two agreeing replicas are a strict majority of 2
        assert consensus.n_undecided == 0
    assert consensus.accuracy == sum(truth) / len(truth) and consensus.n_samples == len(truth)
    assert consensus.agreement == 1.0 and consensus.dissenters == ()
    assert not consensus.partial  # (emitted early when a strict majority of every sample's replicas agreed)


def test_each_rank_does_redundancy_over_world_of_the_set() -> None:
    sizes = [len(covered(layout(64, 4, 4, 2, rank), 4)) for rank in range(4)]
    assert sizes == [128] * 4  # 2/4 of 256 samples each
    assert len(covered(layout(64, 4, 4, 4, 0), 4)) == 256  # redundancy = world: everything, from offset 0
    every = [s for rank in range(4) for s in covered(layout(64, 4, 4, 2, rank), 4)]
    assert sorted(every) == sorted(list(range(256)) * 2)  # each sample exactly twice


def test_a_wrong_replica_is_outvoted_with_three_and_left_undecided_with_two() -> None:
    truth = [1, 0] * 24  # 12 prompts x 4 samples
    flips = {1: set(range(0, 48, 3))}
    three = vote(node_results(truth, 12, 4, 4, 3, flips), 4, 3)
    assert three.accuracy == 0.5 and three.dissenters == ("n1",)  # the two honest replicas of each sample win
    assert three.n_undecided == 0
    two = vote(node_results(truth, 12, 4, 4, 2, flips), 4, 2)
    # two replicas detect the fault but cannot say which one it is: a 1-1 tie is undecided,
    # nobody is named, and the accuracy is that of the samples the replicas agree on
    wrong = {s for s in range(48) if s % 3 == 0 and s in covered(layout(12, 4, 4, 2, 1), 4)}
    assert two.dissenters == () and two.n_undecided == len(wrong) and two.n_samples == 48 - len(wrong)
    assert two.accuracy == sum(truth[s] for s in range(48) if s not in wrong) / (48 - len(wrong))
