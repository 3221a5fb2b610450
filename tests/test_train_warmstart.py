"""The warm start's cache: keyed by its whole recipe, and a file of another recipe is refused at load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from areal_metrics.areal_train import warmstart
from areal_metrics.areal_train.task import DATASETS, EVAL_EXCLUDE_SIZE, SKILLS, eval_prompts
from areal_metrics.areal_train.settings import TrainerSettings
from areal_metrics.areal_train.warmstart_cache import WarmStartSpec, path_for

TINY = WarmStartSpec(d_model=32, layers=1, heads=2, steps=10, batch=8)


@pytest.mark.parametrize("change", [{"steps": 11}, {"lr": 1e-3}, {"batch": 16}, {"seed": 1}, {"scratch_share": 0.5},
                                    {"retry_share": 0.2}, {"d_model": 64}, {"second_guess_share": 0.3},
                                    {"label_smoothing": 0.0}, {"label_smoothing": 0.2},
                                    {"level_weights": (0.5, 0.4, 0.1)}])
def test_every_number_of_the_recipe_is_in_the_key(change) -> None:
    assert dataclasses.replace(TINY, **change).key() != TINY.key()


def test_the_examples_keep_every_skill_and_levels_share_and_no_evaluation_prompt() -> None:
    # Distinct draws would hold about 740 two-digit-plus-one-digit sums of the 19,200 (0.04, not 0.0875),
    # and 91 level-1 linear problems (0.005). The held-out evaluation prompts take a share of a small
    # space (linear level 1 has 162 problems, a fifth of them held out), hence the relative bound.
    spec = WarmStartSpec(steps=300)
    problems = warmstart.problems_for(spec)
    assert len(problems) == 300 * 64
    for skill in SKILLS:
        for level, weight in zip((1, 2, 3), spec.level_weights):
            share = sum(p.skill == skill and p.level == level for p in problems) / len(problems)
            assert abs(share / (weight / len(SKILLS)) - 1) < 0.25, (skill, level, share)
    assert not {p.prompt for p in problems} & eval_prompts({name: EVAL_EXCLUDE_SIZE for name in DATASETS})


def test_the_thread_count_is_not() -> None:
    assert dataclasses.replace(TINY, threads=4).key() == TINY.key()


def test_load_refuses_a_file_of_another_recipe(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path))
    cache = TrainerSettings.from_env().warmstart_dir()  # as an entry point reads it
    assert cache == tmp_path / "warmstart"
    policy = warmstart.load(TINY, cache=cache)
    assert policy.n_parameters() > 0
    saved = torch.load(path_for(TINY, cache), weights_only=True)
    assert saved["key"] == TINY.key() and saved["spec"]["scratch_share"] == TINY.scratch_share
    saved["key"] = "0123456789abcdef"  # e.g. a file copied from another recipe under this name
    torch.save(saved, path_for(TINY, cache))
    with pytest.raises(RuntimeError, match="a warm start of recipe 0123456789abcdef where"):
        warmstart.load(TINY, cache=cache)


def test_a_second_guess_follows_the_answer_in_its_share_of_examples_and_share_0_changes_nothing() -> None:
    import random

    from areal_metrics.areal_train.grader import grade

    problems = warmstart.problems_for(WarmStartSpec(steps=4, batch=50))
    plain = [warmstart.example(p, random.Random(i)) for i, p in enumerate(problems)]
    zero = [warmstart.example(p, random.Random(i), second_guess_share=0.0) for i, p in enumerate(problems)]
    assert plain == zero  # the same random stream: the default recipe's examples (and key) stay
    guessed = [warmstart.example(p, random.Random(i), retry_share=0.0, second_guess_share=1.0)
               for i, p in enumerate(problems)]
    for p, (tokens, mask) in zip(problems, guessed):
        response = [t for t, trained in zip(tokens, mask) if trained]
        assert response.count("#") == 2 and response[-1] == "<eos>"
        assert not grade(p, response).correct  # the grader reads the second, wrong answer


def test_label_smoothing_spreads_its_share_of_the_target_over_the_writable_tokens() -> None:
    import random

    torch.manual_seed(0)
    policy = warmstart.Policy(16, 1, 2)
    problems = warmstart.problems_for(WarmStartSpec(steps=1, batch=4))
    ids, valid, target = warmstart.batch_tensors([warmstart.example(p, random.Random(i)) for i, p in enumerate(problems)])
    plain = warmstart.supervised_loss(policy, ids, valid, target)
    smoothed = warmstart.supervised_loss(policy, ids, valid, target, label_smoothing=0.1)
    log_probs = torch.log_softmax(policy.logits(policy(ids, valid)[:, :-1]), dim=-1)
    writable = policy.writable
    spread = -(log_probs[..., writable].mean(-1) * target[:, 1:]).sum() / target[:, 1:].sum()
    assert torch.allclose(smoothed, 0.9 * plain + 0.1 * spread, atol=1e-5)
    assert not torch.allclose(smoothed, plain)
