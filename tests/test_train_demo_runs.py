"""The demo's run list: compared strategies over seeds with one loop setting and no faults; the faults in a
run of their own, where a majority can outvote the faulty rank; a run whose learning rate is too high."""

from __future__ import annotations

import argparse

import pytest

from areal_metrics.commands import demo
from areal_metrics.errors import UserError


def runs(tmp_path=None, **kw):
    args = argparse.Namespace(config=None, seeds=3, nproc=2, **kw)
    return demo.run_configs(args, "000000")


def test_compared_runs_differ_only_by_strategy_and_seed() -> None:
    configured = runs()
    groups = demo.compared_runs(configured)
    assert set(groups) == {"mt4-grpo", "mt2-grpo"} and all(len(ids) == 3 for ids in groups.values())
    compared = [configured[r][1] for ids in groups.values() for r in ids]
    assert {c.seed for c in compared} == {1, 2, 3}
    assert {c.max_turns for c in compared} == {4, 2}
    for c in compared:
        assert c.eval_loop == demo.LOOP
        assert not c.two_stage  # a full-stage round every eval_every_steps: a slope to test
        assert c.fail_eval_rounds == () and c.fail_eval_at_steps == () and c.dissent_rank is None
        assert c.corrupt_eval_rank is None
        neutral = c.replace(seed=0, max_turns=1, group="x")
        assert neutral == compared[0].replace(seed=0, max_turns=1, group="x")  # everything else equal


def test_the_faults_have_a_run_of_three_ranks_where_a_majority_outvotes_one() -> None:
    configured = runs()
    (vote_id,) = [r for r in configured if r.endswith("-vote")]
    ranks, cfg = configured[vote_id]
    # sharded (shard_nodes 3 > replicas 2), the third rank adjudicating what two replicas dispute: 2 against 1
    assert ranks >= 3 and cfg.eval_redundancy == 2 < ranks
    from areal_metrics.areal_train.evalsets import adjudicates
    assert adjudicates(ranks, cfg.eval_redundancy)
    assert cfg.dissent_kind == "stuck"  # a systematic fault: its grader returns 0 for every sample
    assert cfg.dissent_rank is not None and 0 <= cfg.dissent_rank < ranks and cfg.fail_eval_rounds


def test_the_regression_run_has_a_too_high_learning_rate_and_the_same_loop() -> None:
    configured = runs()
    (high_id,) = [r for r in configured if r.endswith("-lr-high")]
    cfg = configured[high_id][1]
    base = configured[demo.compared_runs(configured)["mt4-grpo"][0]][1]
    assert cfg.rl_parameters == "." and base.rl_parameters != "." and cfg.lr == demo.REGRESSION["lr"]
    assert cfg.eval_loop == base.eval_loop and cfg.group not in demo.STRATEGIES
    assert cfg.two_stage == base.two_stage


def test_a_config_file_wins_over_the_demos_settings_and_a_bad_one_is_a_user_error(tmp_path) -> None:
    good = tmp_path / "c.toml"
    good.write_text("eval_every_steps = 3\n")
    configured = demo.run_configs(argparse.Namespace(config=good, seeds=1, nproc=1), "x")
    assert {c.eval_every_steps for _, c in configured.values()} == {3}
    bad = tmp_path / "bad.toml"
    bad.write_text('eval_mode = "whenever"\n')
    with pytest.raises(UserError, match="eval_mode"):
        demo.run_configs(argparse.Namespace(config=bad, seeds=1, nproc=1), "x")


def test_eval_loop_reaches_the_run_config_only_when_set_and_unknown_keys_are_refused() -> None:
    from areal_metrics.areal_train.config import TrainConfig, from_mapping
    from areal_metrics.producers.contract.errors import ConfigError

    assert "eval_loop" not in TrainConfig().to_dict()
    cfg = from_mapping({"eval_loop": {"enabled": True, "threshold": 0.1}})
    assert cfg.to_dict()["eval_loop"] == {"enabled": True, "threshold": 0.1}
    assert from_mapping(cfg.to_dict()) == cfg  # what launch passes to the ranks as JSON
    with pytest.raises(ConfigError, match="eval_loop: unknown key thresh"):
        from_mapping({"eval_loop": {"thresh": 0.1}})
    with pytest.raises(ConfigError, match=r"eval_loop: Expected `object \| null`, got `float` \(0.1\)"):
        from_mapping({"eval_loop": 0.1})


def test_a_stuck_grader_is_a_fault_the_config_names_and_its_verdicts_are_all_wrong_answers() -> None:
    from areal_metrics.areal_train.config import ConfigError, TrainConfig
    from areal_metrics.areal_train.evaluation import _flipped

    assert _flipped((1, 0, 1, 1), "stuck") == (0, 0, 0, 0)
    assert _flipped((1, 0, 1, 1, 1), "flip") == (0, 0, 1, 1, 0)  # every fourth, as before
    assert TrainConfig(dissent_rank=1, dissent_kind="stuck").dissent_kind == "stuck"
    with pytest.raises(ConfigError, match="dissent_kind"):
        TrainConfig(dissent_kind="random")
