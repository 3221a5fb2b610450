"""Pure pieces of the trainer: task and verifier, advantages, config, evaluation rounds."""

from __future__ import annotations

import json

import pytest
import torch

from areal_train import advantages as adv
from areal_train.config import ConfigError, TrainConfig, load
from areal_train.evaluation import Evaluator, evaluate_problems
from areal_train.policy import Policy, answer_mask, encode_prompts
from areal_train.task import EOS_ACTION, Problem, decode_response, make_problems, verify
from producers.events import EvalEvent


# ------------------------------------------------------------------ task


def test_verifier_accepts_exactly_the_right_terminated_answer() -> None:
    p = Problem(7, 8)
    assert p.text == "7+8=" and p.answer == "15"
    assert verify(p, "15") == 1.0
    for wrong in ("16", "015", "1", "", None):
        assert verify(p, wrong) == 0.0


def test_decode_stops_at_the_end_token_and_refuses_unterminated_answers() -> None:
    assert decode_response([1, 5, EOS_ACTION, 3]) == "15"
    assert decode_response([EOS_ACTION]) == ""
    assert decode_response([1, 5, 3, 3]) is None


def test_datasets_have_the_difficulty_their_names_say_and_are_seeded() -> None:
    easy, hard = make_problems("add_1digit", 64, seed=1), make_problems("add_2digit", 64, seed=1)
    assert all(0 <= p.a <= 9 and 0 <= p.b <= 9 for p in easy)
    assert all(10 <= p.a <= 99 and 10 <= p.b <= 99 for p in hard)
    assert len(set(easy)) == 64  # distinct while the dataset has enough
    assert make_problems("add_1digit", 64, seed=1) == easy
    assert make_problems("add_1digit", 64, seed=2) != easy
    assert len(make_problems("add_1digit", 250, seed=0)) == 250  # more than 100 pairs: repeats


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


def test_gae_with_lambda_zero_is_the_one_step_td_error() -> None:
    mask = torch.ones(1, 3)
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.1, 0.3, 0.5]])
    advantages, _ = adv.gae(rewards, values, mask, gamma=1.0, lam=0.0)
    assert torch.allclose(advantages, torch.tensor([[0.2, 0.2, 0.5]]))


def test_answer_mask_covers_the_answer_up_to_its_end_token() -> None:
    actions = torch.tensor([[3, EOS_ACTION, 4, 4], [1, 2, 3, 4], [EOS_ACTION, 1, EOS_ACTION, 1]])
    assert answer_mask(actions).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_scoring_reproduces_the_sampling_log_probs() -> None:
    torch.manual_seed(0)
    policy = Policy(hidden=16)
    prompts = encode_prompts(make_problems("add_1digit", 8, 0))
    rollout = policy.generate(prompts, 4)
    logprobs, entropy, _ = policy.score(prompts, rollout.actions)
    assert torch.allclose(logprobs, rollout.logprobs, atol=1e-5)
    assert (entropy > 0).all()


# ---------------------------------------------------------------- config


def test_config_file_overrides_defaults_json_and_toml(tmp_path) -> None:
    (tmp_path / "c.json").write_text(json.dumps({"lr": 0.01, "eval_datasets": ["add_2digit"]}))
    (tmp_path / "c.toml").write_text('eval_mode = "async"\neval_every_steps = 7\n')
    cfg = load(tmp_path / "c.json")
    assert cfg.lr == 0.01 and cfg.eval_datasets == ("add_2digit",) and cfg.group_size == TrainConfig().group_size
    cfg = load(tmp_path / "c.toml")
    assert cfg.eval_mode == "async" and cfg.eval_every_steps == 7


@pytest.mark.parametrize("content, message", [
    ('{"lr": -1}', "lr: must be a finite number > 0"),
    ('{"group_size": 1}', "group_size: must be >= 2"),
    ('{"eval_mode": "later"}', "eval_mode: must be sync or async"),
    ('{"lrr": 0.1}', "unknown key 'lrr'"),
    ('{"batch_prompts": "8"}', "batch_prompts: must be an integer"),
    ('{"eval_datasets": ["gsm8k"]}', "eval_datasets: must be a non-empty list"),
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


# ------------------------------------------------------------- evaluation


def make_evaluator(events: list, **kw) -> Evaluator:
    datasets = {"add_1digit": make_problems("add_1digit", 20, 3), "add_2digit": make_problems("add_2digit", 20, 3)}
    return Evaluator(events.append, "run-1", "node-a", 0, 2, datasets, 4, torch.device("cpu"), quick_size=5, **kw)


def test_two_stage_round_publishes_quick_then_full_for_each_dataset() -> None:
    torch.manual_seed(0)
    events: list[EvalEvent] = []
    make_evaluator(events).evaluate(Policy(hidden=16), step=10)
    assert [(e.stage, e.dataset, e.n_samples) for e in events] == [
        ("quick", "add_1digit", 5), ("quick", "add_2digit", 5), ("full", "add_1digit", 20), ("full", "add_2digit", 20)]
    assert all(e.status == "ok" and e.replicas == 2 and e.step == 10 for e in events)
    assert events[0].verdicts == events[2].verdicts[:5]  # the quick stage is a prefix of the full set
    assert events[2].eval_id == "run-1:10:add_1digit:full"


def test_verdicts_follow_the_problem_order_and_are_deterministic() -> None:
    torch.manual_seed(0)
    policy = Policy(hidden=16)
    problems = make_problems("add_1digit", 30, 0)
    full = evaluate_problems(policy, problems, 4, torch.device("cpu"))
    parts = evaluate_problems(policy, problems[:10], 4, torch.device("cpu"), batch=3)
    assert full.verdicts[:10] == parts.verdicts and len(full.verdicts) == 30


def test_an_exception_during_evaluation_publishes_failed_and_returns() -> None:
    events: list[EvalEvent] = []
    make_evaluator(events, fail_at_steps=(5,), two_stage=False).evaluate(Policy(hidden=16), step=5)
    assert [e.status for e in events] == ["failed", "failed"]
    assert "injected evaluation failure at step 5" in events[0].error and events[0].accuracy is None


def test_a_failure_can_be_injected_by_round_whatever_its_step() -> None:
    events: list[EvalEvent] = []
    evaluator = make_evaluator(events, fail_rounds=(2,), two_stage=False)
    for step in (0, 7, 9):
        evaluator.evaluate(Policy(hidden=16), step=step)
    assert [(e.step, e.status) for e in events] == [(0, "ok"), (0, "ok"), (7, "failed"), (7, "failed"),
                                                    (9, "ok"), (9, "ok")]
    assert "(round 2)" in events[2].error


def test_asynchronous_round_evaluates_the_snapshot_taken_when_asked() -> None:
    torch.manual_seed(0)
    policy = Policy(hidden=16)
    sync_events: list[EvalEvent] = []
    make_evaluator(sync_events).evaluate(policy, step=1)
    async_events: list[EvalEvent] = []
    evaluator = make_evaluator(async_events, asynchronous=True)
    evaluator.evaluate(policy, step=1)
    with torch.no_grad():  # training goes on and changes the weights meanwhile
        for p in policy.parameters():
            p.add_(torch.randn_like(p))
    evaluator.close()
    assert [e.verdicts for e in async_events] == [e.verdicts for e in sync_events]


def test_a_dissenting_replica_flips_some_verdicts() -> None:
    torch.manual_seed(0)
    policy = Policy(hidden=16)
    honest: list[EvalEvent] = []
    faulty: list[EvalEvent] = []
    make_evaluator(honest, two_stage=False).evaluate(policy, 1)
    make_evaluator(faulty, two_stage=False, dissent=True).evaluate(policy, 1)
    assert honest[0].verdicts != faulty[0].verdicts
