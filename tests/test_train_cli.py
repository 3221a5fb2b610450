"""`areal-metrics train`: arguments, config errors as one line with exit 2, a short run."""

from __future__ import annotations

import pytest

from areal_metrics.cli import main
from areal_train.metrics import choose_device


@pytest.mark.parametrize("argv, message", [
    (["--run-id", "bad id"], "--run-id: 'bad id' must be 1..128 chars"),
    (["--run-id", "ok", "--nproc", "0"], "--nproc: must be in 1..64"),
    (["--run-id", "ok", "--steps", "0"], "--steps: must be >= 1"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys) -> None:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_bad_config_file_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('eval_mode = "whenever"\n')
    assert main(["train", "--run-id", "ok", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.toml: eval_mode: must be sync or async" in err


def test_a_short_run_without_kafka(tmp_path, capsys) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"eval_every_steps": 3, "eval_size": 8, "two_stage": false}')
    code = main(["train", "--run-id", "cli-run", "--nproc", "2", "--steps", "6", "--config", str(path),
                 "--no-publish", "--log-dir", str(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert code == 0
    device = str(choose_device())  # CUDA where there is one
    assert f"cli-run rank 0: 6 steps on {device}" in out and f"cli-run rank 1: 6 steps on {device}" in out
    assert "evaluations at steps [0, 3, 6]" in out
