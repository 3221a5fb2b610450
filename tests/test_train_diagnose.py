"""The warm-start diagnostic: greedy, sampled and pass@k per skill and level, and `train --diagnose`."""

from __future__ import annotations

import torch

from areal_metrics.areal_train.diagnose import Verdicts, answer_all, diagnose, summarise, table
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.task import DATASETS, make_eval_set
from areal_metrics.cli import main


def test_summarise_counts_greedy_sampled_and_pass_at_k() -> None:
    p = make_eval_set("math_id", 3)
    verdicts = [Verdicts(p[0], 1, (1, 0, 0, 0)), Verdicts(p[1], 0, (0, 0, 0, 0)), Verdicts(p[2], 0, (1, 1, 1, 1))]
    row = summarise("math_id", "all", None, verdicts)
    assert row.n_prompts == 3 and row.greedy == 1 / 3 and row.pass_at_k == 2 / 3
    assert abs(row.sampled - 5 / 12) < 1e-12
    per_prompt = [0.25, 0.0, 1.0]  # the SE is over prompts (samples of one prompt are not independent)
    var = sum((x - 5 / 12) ** 2 for x in per_prompt) / 2
    assert abs(row.sampled_se - (var / 3) ** 0.5) < 1e-12


def test_every_skill_and_level_of_both_sets_gets_a_row_and_the_sets_a_total() -> None:
    torch.manual_seed(0)
    policy = Policy(d_model=32, layers=1, heads=2)
    rows = diagnose(policy, size=48, k=2, attempt_len=6)
    for dataset in DATASETS:
        mine = [r for r in rows if r.dataset == dataset]
        total = mine[-1]
        assert total.skill == "all" and total.n_prompts == 48
        assert sum(r.n_prompts for r in mine[:-1]) == 48
        assert all(0 <= r.greedy <= 1 and 0 <= r.sampled <= r.pass_at_k <= 1 for r in mine)
    assert {r.level for r in rows if r.dataset == "math_hard" and r.skill != "all"} == {3}
    assert {(r.skill, r.level) for r in rows if r.dataset == "math_id"} >= {("add", 1), ("word", 3), ("all", None)}
    text = table(rows, 2)
    assert text.splitlines()[0].startswith("| set | skill | level") and "pass@2" in text
    assert len(text.splitlines()) == len(rows) + 2


def test_sampling_is_seeded_and_greedy_does_not_depend_on_the_seed() -> None:
    torch.manual_seed(1)
    policy = Policy(d_model=32, layers=1, heads=2)
    problems = make_eval_set("math_hard", 8)
    a = answer_all(policy, problems, 3, 6, seed=5)
    b = answer_all(policy, problems, 3, 6, seed=5)
    c = answer_all(policy, problems, 3, 6, seed=6)
    assert a == b and [v.greedy for v in a] == [v.greedy for v in c]


def test_train_diagnose_prints_the_table_of_the_configs_warm_start(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("AREAL_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "c.toml"
    config.write_text("d_model = 32\nlayers = 1\nheads = 2\nwarmstart_steps = 20\nmax_response_len = 8\n")
    assert main(["train", "--diagnose", "--config", str(config), "--diagnose-size", "16", "--diagnose-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "| math_id | **all** | all | 16 |" in out and "| math_hard | **all** | all | 16 |" in out
    assert "pass@2" in out


def test_train_diagnose_bad_input_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    assert main(["train", "--diagnose", "--diagnose-size", "1"]) == 2
    assert "--diagnose-size: must be in 2..512" in capsys.readouterr().err
    config = tmp_path / "c.toml"
    config.write_text("warmstart_steps = 0\n")
    assert main(["train", "--diagnose", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "no warm start" in err and err.count("\n") == 1
    assert main(["train"]) == 2
    assert "--run-id: required" in capsys.readouterr().err


def test_the_slope_t_matches_the_textbook_ols() -> None:
    import numpy as np

    from areal_metrics.areal_train.learning import ols_slope_t as slope_t

    xs, ys = [0.0, 10, 20, 30, 40, 50], [0.03, 0.05, 0.04, 0.08, 0.09, 0.12]
    x, y = np.array(xs), np.array(ys)
    beta = np.polyfit(x, y, 1)[0]
    resid = y - np.polyval(np.polyfit(x, y, 1), x)
    se = np.sqrt(resid @ resid / (len(x) - 2) / ((x - x.mean()) ** 2).sum())
    assert abs(slope_t(xs, ys) - beta / se) < 1e-9
    assert slope_t([0.0, 1.0], [0.0, 1.0]) != slope_t([0.0, 1.0], [0.0, 1.0])  # nan: too few rounds


def test_the_probes_supervised_step_teaches_the_worked_solutions() -> None:
    import random

    import torch

    from areal_metrics.areal_train.policy import Policy
    from areal_metrics.areal_train.probe import supervised_step
    from areal_metrics.areal_train.task import make_train_set

    torch.manual_seed(0)
    policy = Policy(d_model=32, layers=1, heads=2)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    problems = make_train_set(8, seed=3, exclude=frozenset())
    losses = [supervised_step(policy, optimizer, problems, random.Random(0), 1.0) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]  # the same eight solutions, learnt
