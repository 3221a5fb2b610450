"""Generations a person can read (issue 32): the samples an eval event keeps are the first sample of a
fixed, seeded choice of prompts per dataset, spread over the set (the same prompts every round, on
whichever rank holds them), each with its gold answer and error type; and the greedy accuracy."""

from __future__ import annotations

import torch

from areal_metrics.areal_train.evalsets import EvalSet, layout
from areal_metrics.areal_train.evaluation import (
    SHOWN_PROMPTS,
    evaluate_shard,
    greedy_accuracy,
    shown_prompts,
)
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.task import make_eval_set

CPU = torch.device("cpu")


def policy(seed: int) -> Policy:
    torch.manual_seed(seed)
    return Policy(d_model=32, layers=2, heads=2).eval()


def evalset(n: int = 24, k: int = 2, name: str = "math_id") -> EvalSet:
    return EvalSet(name, tuple(make_eval_set(name, n)), k=k, attempt_len=8, seed=7)


def round_samples(p: Policy, s: EvalSet, world: int, redundancy: int) -> list[dict]:
    out = []
    for rank in range(world):
        result = evaluate_shard(p, s, layout(len(s.problems), s.k, world, redundancy, rank), CPU, shard_nodes=world)
        out.extend(result.samples)
    return out


def test_a_sharded_round_shows_the_same_spread_prompts_every_round_with_gold_and_error_type() -> None:
    s = evalset()
    chosen = shown_prompts(s)
    assert len(chosen) == SHOWN_PROMPTS and max(chosen) >= len(s.problems) // 2  # spread, not the head
    texts = {s.problems[i].text: s.problems[i] for i in chosen}
    rounds = [round_samples(policy(seed), s, world=4, redundancy=2) for seed in (0, 1)]
    for samples in rounds:
        assert {r["prompt"] for r in samples} == set(texts)  # every chosen prompt, on whichever rank holds it
        assert len(samples) == 2 * SHOWN_PROMPTS  # two replicas of each
        for r in samples:
            assert r["gold"] == str(texts[r["prompt"]].answer)
            assert (r["error_type"] == "") == (r["verdict"] == 1)
    assert {r["prompt"] for r in rounds[0]} == {r["prompt"] for r in rounds[1]}  # comparable over steps


def test_the_choice_is_fixed_per_dataset_and_differs_between_datasets() -> None:
    assert shown_prompts(evalset()) == shown_prompts(evalset())
    assert shown_prompts(evalset(name="math_id")) != shown_prompts(evalset(name="math_hard"))


def test_greedy_accuracy_is_reported_beside_the_sampled_one() -> None:
    s, p = evalset(n=12), policy(3)
    result = evaluate_shard(p, s, layout(12, s.k, 1, 1, 0), CPU)
    assert result.metrics["greedy_accuracy"] == greedy_accuracy(p, s, list(range(12)), CPU)
    assert result.metrics["greedy_accuracy"] == greedy_accuracy(p, s, list(range(12)), CPU)  # deterministic
