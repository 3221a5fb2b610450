"""`areal-metrics train`: arguments, config errors as one line with exit 2, a short run and its resume."""

from __future__ import annotations

import json

import pytest

from areal_metrics.cli import main
from areal_metrics.areal_train.metrics import choose_device

TINY = {"eval_every_steps": 3, "eval_size": 8, "quick_size": 4, "eval_samples": 2, "two_stage": False,
        "warmstart_steps": 0, "d_model": 32, "layers": 1, "heads": 2, "max_response_len": 8}


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


def test_a_short_run_without_kafka_then_its_resume(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("AREAL_HOME", str(tmp_path / "home"))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(TINY))
    base = ["train", "--run-id", "cli-run", "--nproc", "2", "--config", str(path), "--no-publish",
            "--log-dir", str(tmp_path / "logs")]
    assert main([*base, "--steps", "4", "--resume"]) == 2
    assert "--resume: no checkpoint of run cli-run in" in capsys.readouterr().err
    assert main([*base, "--steps", "6"]) == 0
    out = capsys.readouterr().out
    device = str(choose_device())  # CUDA where there is one
    assert f"cli-run rank 0: 6 steps on {device}" in out and f"cli-run rank 1: 6 steps on {device}" in out
    assert "evaluations at steps [0, 3, 6]" in out
    assert main([*base, "--steps", "6", "--resume"]) == 2
    assert "--steps: 6 is not beyond the checkpoint's step 6" in capsys.readouterr().err
    assert main([*base, "--steps", "9", "--resume", "--nproc", "1"]) == 2
    assert "was written by 2 ranks (got 1)" in capsys.readouterr().err
    assert main([*base, "--steps", "9", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "cli-run rank 1: 9 steps" in out and "(attempt 1, resumed at step 6)" in out
    assert "evaluations at steps [9]" in out
