"""Two gloo ranks without a broker: the time trigger is agreed, so both evaluate at the same steps."""

from __future__ import annotations

import json

from areal_train.config import TrainConfig
from areal_train.launch import launch


def test_time_triggered_evaluations_happen_at_the_same_step_on_every_rank(tmp_path) -> None:
    cfg = TrainConfig(publish=False, eval_every_steps=None, eval_every_seconds=0.1, eval_at_start=False,
                      eval_at_end=False, two_stage=False, eval_size=8)
    assert launch("time-run", 2, 60, cfg, summary_dir=tmp_path, log_dir=tmp_path / "logs", timeout=120) == 0
    summaries = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert summaries[0]["steps"] == summaries[1]["steps"] == 60
    assert len(summaries[0]["eval_steps"]) >= 2  # 60 steps take well over 0.2 s
    assert summaries[0]["eval_steps"] == summaries[1]["eval_steps"]
