"""The per-sample vote of a sharded round: windows laid out by areal_train, voted by streams.

Each node evaluates a cyclic window of the round's samples (areal_metrics.areal_train.evalsets.layout)
and publishes shard_offset / shard_total / shard_redundancy in the event's metrics; the
worker votes each sample among the nodes that cover it.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.areal_train.evalsets import covered, layout
from areal_metrics.producers.contract.events import EvalEvent
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.processor import shard_window
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
                              response_length=10.0, verdicts=verdicts, offset=shard.offset, total=shard.total,
                              redundancy=shard.redundancy))
    return out


def vote(results: list[NodeResult], replicas: int):
    state, found = VoteState.empty(), []
    for r in results:
        state, outcome = add_result(state, KEY, 10, replicas, r, 0.0, CFG)
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
    consensus = vote(results, world)
    assert consensus.accuracy == sum(truth) / len(truth)
    assert consensus.agreement == 1.0 and consensus.dissenters == ()
    assert not consensus.partial  # (emitted early when a strict majority of every sample's replicas agreed)


def test_each_rank_does_redundancy_over_world_of_the_set() -> None:
    sizes = [len(covered(layout(64, 4, 4, 2, rank), 4)) for rank in range(4)]
    assert sizes == [128] * 4  # 2/4 of 256 samples each
    assert len(covered(layout(64, 4, 4, 4, 0), 4)) == 256  # redundancy = world: everything, from offset 0
    every = [s for rank in range(4) for s in covered(layout(64, 4, 4, 2, rank), 4)]
    assert sorted(every) == sorted(list(range(256)) * 2)  # each sample exactly twice


def test_a_wrong_replica_is_outvoted_with_three_and_named_with_two() -> None:
    truth = [1, 0] * 24  # 12 prompts x 4 samples
    flips = {1: set(range(0, 48, 3))}
    three = vote(node_results(truth, 12, 4, 4, 3, flips), 4)
    assert three.accuracy == 0.5 and three.dissenters == ("n1",)  # the two honest replicas of each sample win
    two = vote(node_results(truth, 12, 4, 4, 2, flips), 4)
    # two replicas detect the fault but cannot say which one it is: a 1-1 tie counts as not
    # solved, so the honest replica that said 1 is off the consensus too
    assert "n1" in two.dissenters and two.agreement < 1.0 and two.accuracy < 0.5


def test_the_worker_reads_the_window_from_the_event_metrics() -> None:
    common = dict(run_id="run-a", eval_id="e", step=1, dataset="math_id", stage="full", accuracy=0.5,
                  n_samples=2, verdicts=[1, 0])
    window = {"shard_offset": 4.0, "shard_total": 8.0, "shard_redundancy": 2.0}
    assert shard_window(EvalEvent(**common, metrics=window)) == {"offset": 4, "total": 8, "redundancy": 2}
    assert shard_window(EvalEvent(**common)) == {}  # an unsharded event: the classic vote
    assert shard_window(EvalEvent(**common, metrics={**window, "shard_offset": 8.0})) == {}  # offset outside
    assert shard_window(EvalEvent(**common, metrics={**window, "shard_total": 1.0})) == {}  # more verdicts than samples
    assert shard_window(EvalEvent(**common, metrics={**window, "shard_offset": 0.5})) == {}
