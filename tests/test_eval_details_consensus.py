"""pass@K, maj@K and greedy_accuracy in the round's consensus (CONTRACT.md, "Evaluation details"):
pass@K voted per prompt from the decided verdicts, the rest the agreeing nodes' means weighted by
their sample counts; through the processor into `eval_consensus.metrics`."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.areal_train.evalsets import covered, layout
from areal_metrics.areal_train.evaluation import pass_at_k
from areal_metrics.producers.contract.events import EvalEvent
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.processor import RunState, on_eval
from areal_metrics.streams.core.voting import NodeResult, RoundKey, VoteState, add_result

CFG = RunConfig()
KEY = RoundKey("run-a", "run-a:10:math_id:full", "math_id", "full")


def shard_results(truth: list[int], maj: list[int], greedy: list[int], k: int, world: int, redundancy: int,
                  flips: dict[int, set[int]] | None = None) -> list[NodeResult]:
    """What each rank reports for its window: verdicts, and its pass@k, maj@k, greedy accuracy over its prompts."""
    out = []
    for rank in range(world):
        samples = covered(layout(len(maj), k, world, redundancy, rank), k)
        bad = (flips or {}).get(rank, set())
        verdicts = tuple(1 - truth[s] if s in bad else truth[s] for s in samples)
        prompts = sorted({s // k for s in samples})
        metrics = {f"pass@{k}": pass_at_k(list(verdicts), k),
                   f"maj@{k}": sum(maj[p] for p in prompts) / len(prompts),
                   "greedy_accuracy": sum(greedy[p] for p in prompts) / len(prompts),
                   "errors.carry": 3.0}  # not a consensus metric: left out
        out.append(NodeResult(node=f"n{rank}", ok=True, accuracy=sum(verdicts) / len(verdicts), verdicts=verdicts,
                              sample_ids=tuple(samples), samples_per_prompt=k, metrics=metrics))
    return out


def vote(results: list[NodeResult], world: int, redundancy: int):
    state, found = VoteState(), []
    for r in results:
        state, outcome = add_result(state, KEY, 10, redundancy, r, 0.0, CFG, shard_nodes=world)
        if outcome.consensus is not None:
            found.append(outcome.consensus)
    assert len(found) == 1
    return found[0]


@settings(max_examples=150, deadline=None)
@given(world=st.integers(1, 5), data=st.data())
def test_honest_shards_give_the_whole_sets_metrics_in_any_order(world: int, data) -> None:
    redundancy = data.draw(st.integers(1, world))
    n_prompts = data.draw(st.integers(world, 16))
    k = data.draw(st.integers(1, 4))
    truth = data.draw(st.lists(st.integers(0, 1), min_size=n_prompts * k, max_size=n_prompts * k))
    maj = data.draw(st.lists(st.integers(0, 1), min_size=n_prompts, max_size=n_prompts))
    greedy = data.draw(st.lists(st.integers(0, 1), min_size=n_prompts, max_size=n_prompts))
    results = shard_results(truth, maj, greedy, k, world, redundancy)
    random.Random(data.draw(st.integers(0, 99))).shuffle(results)
    c = vote(results, world, redundancy)
    m = c.metrics
    assert set(m) == {f"pass@{k}", f"maj@{k}", "greedy_accuracy"}
    assert abs(m[f"pass@{k}"] - pass_at_k(truth, k)) < 1e-12  # voted: exact as soon as the round closes
    for name, per_prompt in ((f"maj@{k}", maj), ("greedy_accuracy", greedy)):
        if c.votes == world:  # weighted by sample counts over every node: each prompt counts once
            assert abs(m[name] - sum(per_prompt) / n_prompts) < 1e-12
        else:  # closed early (every sample decided): the mean of the nodes counted
            counted = results[:c.votes]
            weights = [len(r.verdicts or ()) for r in counted]
            expected = sum(r.metrics[name] * w for r, w in zip(counted, weights)) / sum(weights)
            assert abs(m[name] - expected) < 1e-12


def test_pass_at_k_is_voted_so_an_outvoted_replica_does_not_move_it() -> None:
    k, n_prompts = 4, 12
    truth = [0] * (n_prompts * k)
    truth[5] = 1  # one prompt passes
    flips = {1: set(range(0, n_prompts * k, 4))}  # n1 turns a wrong sample of every prompt right
    results = shard_results(truth, [0] * n_prompts, [0] * n_prompts, k, 3, 3, flips)
    assert results[1].metrics["pass@4"] == 1.0  # n1 alone claims every prompt passes
    c = vote(results, 3, 3)
    assert c.dissenters == ("n1",)
    assert c.metrics["pass@4"] == 1 / n_prompts  # the vote: only the prompt that passes


def test_without_verdicts_the_metrics_are_the_agreeing_nodes_weighted_means() -> None:
    def node(name: str, acc: float, n: int, maj: float) -> NodeResult:
        return NodeResult(node=name, ok=True, accuracy=acc, n_samples=n, metrics={"maj@4": maj, "pass@4": maj})

    results = [node("c", 0.95, 100, 0.0), node("a", 0.50, 100, 0.6), node("b", 0.51, 300, 0.7)]
    c = vote(results, 3, 3)
    assert c.dissenters == ("c",)
    assert abs(c.metrics["maj@4"] - (0.6 * 100 + 0.7 * 300) / 400) < 1e-12  # c, outvoted, is not in it
    assert abs(c.metrics["pass@4"] - (0.6 * 100 + 0.7 * 300) / 400) < 1e-12  # no verdicts: not voted


def test_the_consensus_event_carries_the_metrics_and_a_stale_repeat_keeps_them() -> None:
    def ev(node: str, eval_id: str, step: int, status: str = "ok") -> EvalEvent:
        ok = status == "ok"
        return EvalEvent(run_id="r", node=node, eval_id=eval_id, step=step, dataset="d", status=status,
                         accuracy=0.5 if ok else None, verdicts=(1, 0, 1, 0) if ok else None,
                         error=None if ok else "boom", replicas=1, ts=1.0,
                         metrics={"pass@2": 1.0, "maj@2": 0.5, "greedy_accuracy": 0.5, "samples_per_prompt": 2.0}
                         if ok else {})

    state, out = on_eval(RunState("r"), ev("n0", "e1", 10), 1.0, CFG)
    first = [o.event for o in out if o.event.type == "eval_consensus"]
    assert first and first[0].metrics == {"pass@2": 1.0, "maj@2": 0.5, "greedy_accuracy": 0.5}
    state, out = on_eval(state, ev("n0", "e2", 20, "failed"), 2.0, CFG)
    stale = [o.event for o in out if o.event.type == "eval_consensus"]
    assert stale and stale[0].stale and stale[0].metrics == first[0].metrics
