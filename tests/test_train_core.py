"""Pure pieces of the trainer: task and grader, advantages, config, the policy's sampling."""

from __future__ import annotations

import json
import re
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from areal_metrics.areal_train import advantages as adv
from areal_metrics.areal_train.config import ConfigError, TrainConfig, load
from areal_metrics.areal_train.episodes import rollout, sample
from areal_metrics.areal_train.grader import ERROR_TYPES, final_answer, grade
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.task import (
    DATASETS,
    EOS,
    EVAL_EXCLUDE_SIZE,
    GENERATORS,
    SKILLS,
    VOCAB_SIZE,
    column_steps,
    encode,
    eval_prompts,
    fingerprint,
    make_eval_set,
    make_train_set,
)

# ------------------------------------------------------------------ task


@settings(max_examples=300, deadline=None)
@given(skill=st.sampled_from(SKILLS), level=st.integers(1, 3), seed=st.integers(0, 10**6))
def test_every_worked_solution_and_bare_answer_grades_right(skill: str, level: int, seed: int) -> None:
    problem = GENERATORS[skill](random.Random(seed), level)
    assert grade(problem, problem.solution(with_scratch=True)).correct
    assert grade(problem, problem.solution(with_scratch=False)).correct
    assert problem.answer >= 0
    encode(problem.prompt)  # every token is in the vocabulary


@settings(max_examples=200, deadline=None)
@given(a=st.integers(10, 999), b=st.integers(10, 999))
def test_column_scratchpads_spell_the_sum_and_difference(a: int, b: int) -> None:
    steps, _ = column_steps(a, b, subtract=False)
    digits = steps[0::3]  # digit, carry, separator
    assert int("".join(reversed(digits)) or "0") + int(steps[-1]) * 10 ** len(digits) == a + b
    big, small = max(a, b), min(a, b)
    steps, _ = column_steps(big, small, subtract=True)
    assert int("".join(reversed(steps[0::3]))) == big - small and steps[-1] == "0"  # no borrow out of the top


def test_the_hard_set_is_level_three_and_has_its_carries() -> None:
    hard = make_eval_set("math_hard", 64)
    assert {p.level for p in hard} == {3}
    for p in hard:
        if p.skill in ("add", "sub"):
            a, b = (int("".join(part)) for part in "".join(p.prompt[:-1]).replace("-", "+").split("+"))
            assert column_steps(a, b, subtract=p.skill == "sub")[1] >= 2


def test_eval_sets_are_fixed_distinct_and_independent_of_any_run_seed() -> None:
    first = make_eval_set("math_id", 64)
    assert first == make_eval_set("math_id", 64) and len({p.prompt for p in first}) == 64
    assert make_eval_set("math_id", 128)[:64] == first  # a larger set starts with the smaller one
    assert fingerprint(first) == fingerprint(make_eval_set("math_id", 64))
    assert fingerprint(first) != fingerprint(first[:63])


def test_training_never_draws_an_evaluation_prompt() -> None:
    exclude = eval_prompts({name: EVAL_EXCLUDE_SIZE for name in DATASETS})
    train = make_train_set(3000, seed=5, exclude=exclude)
    assert len({p.prompt for p in train}) == 3000
    assert not {p.prompt for p in train} & exclude
    assert make_train_set(50, seed=5, exclude=exclude) == train[:50]
    assert make_train_set(50, seed=6, exclude=exclude) != train[:50]


# ---------------------------------------------------------------- grader


def test_the_grader_reads_the_last_number_after_hash_and_names_the_error() -> None:
    problem = GENERATORS["add"](random.Random(1), 1)
    n = problem.answer
    right = ["1", "#", *str(n), EOS]
    assert grade(problem, right).correct
    cases = {
        "truncated": ["#", *str(n)],
        "format": ["5", "+", "3", EOS],
        "off_by_one": ["#", *str(n + 1), EOS],
        "carry": ["#", *str(n + 10), EOS],
        "arithmetic": ["#", *str(n + 7), EOS],
    }
    for error, tokens in cases.items():
        result = grade(problem, tokens)
        assert not result.correct and result.error == error, (error, result)
    assert set(cases) == set(ERROR_TYPES) - {"sign", "no_division", "step", "operation"}  # those: other skills
    assert final_answer(["#", "0", "7", EOS]) == (None, "format")  # a leading zero is not the number 7
    assert final_answer(["#", "1", "#", "2", EOS]) == (2, None)  # the last '#' counts
    assert final_answer(["#", EOS]) == (None, "format")


# ------------------------------------------------------------ advantages


def test_group_relative_advantages_are_normalised_within_each_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = adv.group_relative(rewards, group_size=4)
    assert a[:4].mean().abs() < 1e-6 and a[0] > 0 > a[1]
    assert torch.allclose(a[:4].std(unbiased=False), torch.tensor(1.0), atol=1e-4)
    assert torch.equal(a[4:], torch.zeros(4))  # all right: nothing to learn from this group
    with pytest.raises(ValueError):
        adv.group_relative(rewards, group_size=3)


def test_gae_with_lambda_one_is_return_minus_value() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    rewards = adv.terminal_rewards(torch.tensor([1.0, 1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    values = torch.tensor([[0.2, 0.4, 0.6], [0.5, 9.0, 9.0]])
    advantages, returns = adv.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert torch.allclose(advantages, torch.tensor([[0.8, 0.6, 0.4], [0.5, 0.0, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))


# ----------------------------------------------------- policy and sampling


def tiny_policy(seed: int = 0) -> Policy:
    torch.manual_seed(seed)
    return Policy(d_model=32, layers=2, heads=2).eval()


def test_a_rows_answer_does_not_depend_on_the_rest_of_the_batch() -> None:
    """Left padding is invisible and sampling noise is per row: what replicas rely on."""
    policy = tiny_policy()
    problems = make_eval_set("math_id", 6)
    noise = torch.rand(6, 29, VOCAB_SIZE, generator=torch.Generator().manual_seed(3))
    together = rollout(policy, problems, attempt_len=28, noise=noise)
    for i in (0, 3, 5):
        alone = rollout(policy, [problems[i]], attempt_len=28, noise=noise[i:i + 1])
        assert alone.attempts[0] == together.attempts[i]
        assert torch.allclose(alone.logprobs[0, :alone.ids.shape[1]], together.logprobs[i, :alone.ids.shape[1]],
                              atol=1e-5)


def test_scoring_reproduces_the_sampling_log_probs_over_several_turns() -> None:
    from areal_metrics.areal_train.ppo import response_scores

    policy = tiny_policy(1)
    problems = make_eval_set("math_hard", 8)
    episodes = rollout(policy, problems, max_turns=3, attempt_len=6,
                       noise=torch.rand(8, 3 * 7, VOCAB_SIZE, generator=torch.Generator().manual_seed(0)))
    logprobs, entropy, _ = response_scores(policy, episodes, slice(None), 1.0)
    mask = episodes.action > 0
    assert torch.allclose(logprobs[mask], episodes.logprobs[mask], atol=1e-4)
    assert (entropy[mask] > 0).all()
    assert max(len(g) for g in episodes.grades) == 3  # a random policy needs every attempt
    for grades, attempts in zip(episodes.grades, episodes.attempts):
        assert len(grades) == len(attempts) and all(not g.correct for g in grades[:-1])
    # feedback tokens sit between attempts and are never actions
    from areal_metrics.areal_train.task import WRONG_ID
    assert not (episodes.action[episodes.ids == WRONG_ID]).any()


def test_greedy_and_gumbel_sampling() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    token, logp = sample(logits, None, 1.0)
    assert token.item() == 1 and torch.isclose(logp, torch.log_softmax(logits, -1)[0, 1:2]).all()
    counts = torch.zeros(3)
    noise = torch.rand(4000, 3, generator=torch.Generator().manual_seed(0))
    for row in noise:
        counts[sample(logits, row[None], 1.0)[0]] += 1
    assert torch.allclose(counts / 4000, torch.softmax(logits[0], -1), atol=0.03)


def test_rewards_are_discounted_per_extra_attempt() -> None:
    policy = tiny_policy()
    episodes = rollout(policy, make_eval_set("math_id", 2), max_turns=4, attempt_len=4)
    from areal_metrics.areal_train.grader import Grade

    episodes.grades = [[Grade(False, 1, "arithmetic"), Grade(True, 2, None)], [Grade(False, None, "format")] * 4]
    assert episodes.rewards(0.9) == [0.9, 0.0]
    assert episodes.solved_turn == [2, None]


# ---------------------------------------------------------------- config


def test_config_file_overrides_defaults_json_and_toml(tmp_path) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"lr": 0.01, "eval_datasets": ["math_hard"], "max_turns": 4}))
    (tmp_path / "c.toml").write_text('eval_mode = "async"\neval_every_steps = 7\n')
    cfg = load(tmp_path / "c.json")
    assert cfg.lr == 0.01 and cfg.eval_datasets == ("math_hard",) and cfg.group_size == TrainConfig().group_size
    assert cfg.strategy == "mt4-grpo"
    cfg = load(tmp_path / "c.toml")
    assert cfg.eval_mode == "async" and cfg.eval_every_steps == 7
    # JSON's one number type: whole floats where integers are meant (in a list for a tuple too)
    (tmp_path / "n.json").write_text('{"fail_eval_at_steps": [3.0, 4], "seed": 2.0, "lr": 1}')
    cfg = load(tmp_path / "n.json")
    assert (cfg.fail_eval_at_steps, cfg.seed, cfg.lr) == ((3, 4), 2, 1.0) and type(cfg.seed) is int


@pytest.mark.parametrize("content, message", [
    ('{"lr": -1}', "lr: must be > 0 (got -1)"),
    ('{"lr": 1e400}', "lr: not finite"),
    ('{"eval_datasets": []}', "eval_datasets: must be non-empty"),
    ('{"fail_eval_rounds": [1, 0]}', "fail_eval_rounds: Expected `int` >= 1 - at `$[1]`"),
    ('{"group_size": 1}', "group_size: must be >= 2"),
    ('{"eval_mode": "later"}', "eval_mode: must be sync or async"),
    ('{"lrr": 0.1}', "unknown key 'lrr'"),
    ('{"batch_prompts": "8"}', "batch_prompts: Expected `int`, got `str`"),
    ('{"fail_eval_at_steps": [3, 4.5]}', "fail_eval_at_steps: Expected `int`, got `float` - at `$[1]`"),
    ('{"eval_datasets": ["gsm8k"]}', "eval_datasets: must be a non-empty list"),
    ('{"eval_cpu_share": 0}', "eval_cpu_share: must be in (0, 1]"),
    ('{"quick_size": 100, "eval_size": 50}', "quick_size: must be <= eval_size"),
    ('{"ppo_minibatches": 3}', "ppo_minibatches: must divide"),
    ('{"d_model": 30, "heads": 4}', "d_model: must be a multiple of heads"),
    ("{not json", "not valid JSON"),
])
def test_bad_config_values_name_the_key_and_the_file(tmp_path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_missing_config_file_is_a_config_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load(tmp_path / "nope.json")


def test_a_config_built_in_code_or_replaced_is_checked_as_a_file_is() -> None:
    """One declaration per setting (type, Meta range): code, a file and `replace` refuse the same way."""
    for make in (lambda: TrainConfig(lr=-1), lambda: TrainConfig().replace(lr=-1)):
        with pytest.raises(ConfigError, match=re.escape("lr: must be > 0 (got -1)")):
            make()
    with pytest.raises(ConfigError, match="eval_mode: must be sync or async"):
        TrainConfig().replace(eval_mode="later")
    assert TrainConfig().replace(lr=1).lr == 1.0 and type(TrainConfig().replace(seed=2.0).seed) is int
