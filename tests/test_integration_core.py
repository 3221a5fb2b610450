"""The integrations' pure parts, their imports and the frameworks under test (no broker).

- Every package the integration tests need (the `integrations` extra and the
  Makefile's `NO_DEPS`) is installed in a version its pin allows: a missing
  one fails here by name, so a run without the frameworks is never green.
- `import areal_metrics` imports no integration; the AReaL and verl modules
  import neither their framework nor torch until used.
- The TRL callback's decision from commands, and HF evaluation metrics ->
  `log_eval` keywords (a metric named like one of log_eval's parameters
  keeps its `eval_` prefix instead of taking that parameter's place).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from tests.support import ROOT


def requirements_under_test() -> list[Requirement]:
    """The integrations extra of pyproject.toml and the Makefile's NO_DEPS (installed without their requirements)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    no_deps = re.search(r"^NO_DEPS := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert no_deps is not None, "the Makefile has no NO_DEPS line"
    return [Requirement(line) for line in [*extras["integrations"], *no_deps.group(1).split()]]


@pytest.mark.parametrize("requirement", requirements_under_test(), ids=str)
def test_what_the_integration_tests_need_is_installed(requirement: Requirement) -> None:
    try:
        version = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        pytest.fail(f"{requirement.name} is not installed: `make install` installs the integrations extra and the "
                    "Makefile's NO_DEPS (docs/INTEGRATIONS.md)")
    assert requirement.specifier.contains(version, prereleases=True), (
        f"{requirement.name} {version} is outside {requirement}: run `make install`")


def test_importing_the_client_and_the_areal_and_verl_modules_stays_light() -> None:
    code = textwrap.dedent("""
        import sys
        import areal_metrics
        assert "areal_metrics.integrations" not in sys.modules
        import areal_metrics.integrations.areal, areal_metrics.integrations.verl
        heavy = [m for m in ("areal", "verl", "torch", "transformers", "trl", "ray") if m in sys.modules]
        print("heavy", *heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["heavy"]


@pytest.mark.parametrize("accuracy_key", ["eval_accuracy", "eval_reward"])
def test_evaluation_metrics_become_log_eval_keywords(accuracy_key: str) -> None:
    from areal_metrics.integrations.trl import eval_result

    metrics = {"eval_accuracy": 0.75, "eval_reward": 0.75, "eval_runtime": 2.5, "eval_completions/mean_length": 4.0,
               "eval_loss": 0.1, "eval_status": 3.0, "eval_samples": 8.0, "epoch": 0.5}
    got = eval_result(metrics, accuracy_key)
    assert got is not None and got["accuracy"] == 0.75
    assert got["reward"] == 0.75 and got["response_length"] == 4.0 and got["latency_ms"] == 2500.0
    assert got["loss"] == 0.1 and got["eval_status"] == 3.0 and got["eval_samples"] == 8.0  # not log_eval's own
    assert "status" not in got and "samples" not in got and "epoch" not in got
    assert eval_result({"eval_loss": 0.1}, accuracy_key) is None


def test_trl_token_counts_become_tokens_per_step_and_throughput() -> None:
    from areal_metrics.integrations.trl import TokenMark, token_columns

    start = TokenMark(0.0, 0, 10.0)
    values, mark = token_columns(start, 1200, 3, 14.0)  # 3 steps since the start, 4 s of wall time
    assert values == {"tokens": 400.0, "throughput": 300.0} and mark == TokenMark(1200.0, 3, 14.0)
    assert token_columns(mark, 1200, 4, 15.0)[0] == {}  # no growth (an evaluation's log): nothing
    assert token_columns(mark, 900, 4, 15.0) == ({}, TokenMark(900.0, 4, 15.0))  # a counter that went back
    for bad in (None, "12", float("nan"), True):
        assert token_columns(mark, bad, 5, 16.0) == ({}, mark)


@pytest.mark.parametrize(("strategy", "eval_steps", "logging_steps", "max_steps", "expected"), [
    ("steps", 500, 10, 1000, 500), ("steps", 0.1, 10, 1000, 100), ("steps", None, 10, 1000, 10),
    ("steps", 0.1, 10, -1, None), ("epoch", 500, 10, 1000, None), ("no", 500, 10, 1000, None)])
def test_the_trl_evaluation_interval_is_the_users(strategy, eval_steps, logging_steps, max_steps, expected) -> None:
    from types import SimpleNamespace

    from areal_metrics.integrations.trl import eval_interval

    args = SimpleNamespace(eval_strategy=strategy, eval_steps=eval_steps, logging_steps=logging_steps)
    assert eval_interval(args, max_steps) == expected


def test_trl_completions_logged_during_an_evaluation_become_samples() -> None:
    from areal_metrics.integrations.trl import completion_samples

    before = ["train prompt"]
    logs = {"prompt": [before[0], "1+1=", [{"role": "user", "content": "2+2="}]],
            "completion": ["t", "2", [{"role": "assistant", "content": "4"}]],
            "rewards": {"digit": [1.0, 1.0, float("nan")], "len": [0.0, 0.5, 0.5]}}
    samples = completion_samples(logs, frozenset(map(id, before)))
    assert samples == [{"prompt": "1+1=", "response": "2", "reward": 1.5},
                       {"prompt": "2+2=", "response": "4", "reward": 0.5}]
    # TRL keeps its last completions (hundreds): the eval event takes SAMPLES_MAX, the last ones, so
    # `log_eval` has nothing to cut and no warning to give each evaluation
    from areal_metrics.producers.contract.field_rules import SAMPLES_MAX

    many = {"prompt": [f"{i}+1=" for i in range(300)], "completion": [str(i + 1) for i in range(300)]}
    kept = completion_samples(many)
    assert len(kept) == SAMPLES_MAX and kept[-1] == {"prompt": "299+1=", "response": "300"}


def test_the_adapters_derive_a_valid_id_from_any_experiment_name_and_keep_the_name() -> None:
    from types import SimpleNamespace

    from areal_metrics.integrations import areal, verl
    from areal_metrics.producers.client.run_info import run_id_for

    tracking = SimpleNamespace(_areal_metrics_names=("proj", "exp lr=1e-6", None))
    assert verl._defaults(tracking) | {"config": None} == {
        "framework": "verl", "config": None, "run_id": run_id_for("exp lr=1e-6"), "name": "exp lr=1e-6", "group": "proj"}
    assert verl._defaults(SimpleNamespace(_areal_metrics_names=("p", "plain", None)))["run_id"] == "plain"
    logger = SimpleNamespace(config=SimpleNamespace(experiment_name="gsm8k/grpo", trial_name="trial 0"), exp_config=None)
    found = areal._defaults(logger)
    assert found["run_id"] == run_id_for("gsm8k/grpo-trial 0") and found["name"] == "gsm8k/grpo-trial 0"


def test_a_checkpoint_rollback_restores_every_weight_or_none(tmp_path) -> None:
    """restore_checkpoint puts back a save_pretrained checkpoint whole (its lm_head tied to the embeddings,
    left out of the file), and one that does not match the model (a key of another layout, as an MoE's experts
    are saved; a missing weight) changes nothing and says why. Before, `strict=False` loaded every key that
    matched, then reported a mismatch: part of the model rolled back, the ack saying it had not."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    from areal_metrics.integrations.trl import restore_checkpoint

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=40, n_positions=16, n_embd=8, n_layer=2, n_head=2))
    model.save_pretrained(tmp_path / "checkpoint-2")
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    args = type("Args", (), {"output_dir": str(tmp_path)})()

    def perturb() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)

    def unchanged_since(before: dict) -> bool:
        return all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    perturb()
    assert restore_checkpoint(args, model, None, 3) == 2
    assert unchanged_since(saved)  # every weight back, the tied lm_head with its embeddings

    file = tmp_path / "checkpoint-2" / "model.safetensors"
    whole = load_file(str(file))
    for change in ("renamed", "dropped"):
        state = dict(whole)
        key = "transformer.h.1.mlp.c_fc.weight"
        value = state.pop(key)
        if change == "renamed":
            state["transformer.h.1.mlp.experts.0.weight"] = value
        save_file(state, str(file))
        perturb()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        why = restore_checkpoint(args, model, None, 3)
        assert isinstance(why, str) and "nothing restored" in why, why
        assert ("not in the model" if change == "renamed" else "missing") in why, why
        assert unchanged_since(before), change  # nothing loaded


def test_a_resume_without_the_callbacks_state_reads_the_factor_from_the_restored_schedule() -> None:
    """Resumed from a checkpoint outside output_dir, the callback finds no state of its own; HF restored the
    scheduler, whose base lrs a scale_lr scaled: the factor is read from there (before: 1.0, so the next cut
    was bounded from 1.0 while the lrs were at x0.25)."""
    import torch
    from transformers import get_linear_schedule_with_warmup

    from areal_metrics.integrations.trl import scaled_factor
    from areal_metrics.producers.client.trainer_control import scale_schedule

    args = type("Args", (), {"learning_rate": 3e-4})()
    optimizer = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), lr=3e-4)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=20)
    assert scaled_factor(args, scheduler) == 1.0
    scale_schedule(optimizer, scheduler, 0.25)
    restored = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=20)
    restored.load_state_dict(scheduler.state_dict())  # what HF's resume does
    assert scaled_factor(args, restored) == pytest.approx(0.25)
    assert scaled_factor(args, restored, lr_min_factor=0.5) == 0.5 and scaled_factor(args, None) is None
