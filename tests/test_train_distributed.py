"""Several gloo ranks without a broker: agreed triggers, sharded evaluation, the data check, resume."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from areal_metrics.areal_train.collective import Collective
from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.control import Control
from areal_metrics.areal_train.launch import launch
from areal_metrics.producers.contract.events import CommandEvent

TINY = dict(publish=False, d_model=32, layers=2, heads=2, warmstart_steps=0, batch_prompts=4, eval_size=16,
            quick_size=4, eval_samples=2, max_response_len=8, checkpoint_every_steps=None)


def summaries(path: Path, ranks: int) -> list[dict]:
    return [json.loads((path / f"rank{r}.json").read_text()) for r in range(ranks)]


def test_time_triggered_evaluations_happen_at_the_same_step_on_every_rank(tmp_path) -> None:
    cfg = TrainConfig(**TINY, eval_every_steps=None, eval_every_seconds=0.2, eval_at_start=False, eval_at_end=False,
                      two_stage=False, checkpoint_dir=str(tmp_path / "ckpt"))
    assert launch("time-run", 2, 40, cfg, summary_dir=tmp_path, log_dir=tmp_path / "logs", timeout=300) == 0
    s = summaries(tmp_path, 2)
    assert s[0]["steps"] == s[1]["steps"] == 40
    assert len(s[0]["eval_steps"]) >= 2  # 40 steps take well over 0.4 s
    assert s[0]["eval_steps"] == s[1]["eval_steps"]


def test_four_ranks_share_the_full_stage_and_every_rank_checks_the_quick_one(tmp_path) -> None:
    cfg = TrainConfig(**TINY, eval_every_steps=None, eval_at_end=False, eval_redundancy=2, eval_mode="async",
                      checkpoint_dir=str(tmp_path / "ckpt"))
    assert launch("shard-run", 4, 2, cfg, summary_dir=tmp_path, log_dir=tmp_path / "logs", timeout=300) == 0
    for s in summaries(tmp_path, 4):
        done = {(e["dataset"], e["stage"]): e for e in s["evals"]}
        for dataset in ("math_id", "math_hard"):
            assert done[(dataset, "quick")]["status"] == "ok" and done[(dataset, "quick")]["n_samples"] == 4 * 2
            assert done[(dataset, "full")]["status"] == "ok"
            assert done[(dataset, "full")]["n_samples"] == 16 * 2 * 2 // 4  # redundancy / ranks of the set


def test_a_rank_whose_evaluation_data_differs_fails_that_dataset_on_every_rank(tmp_path) -> None:
    cfg = TrainConfig(**TINY, eval_every_steps=None, eval_at_end=False, corrupt_eval_rank=1,
                      checkpoint_dir=str(tmp_path / "ckpt"))
    assert launch("corrupt-run", 2, 1, cfg, summary_dir=tmp_path, log_dir=tmp_path / "logs", timeout=300) == 0
    for s in summaries(tmp_path, 2):
        by = {(e["dataset"], e["stage"]): e for e in s["evals"]}
        assert by[("math_id", "full")]["status"] == by[("math_id", "quick")]["status"] == "failed"
        assert "dataset fingerprint mismatch on math_id: rank 0 holds" in by[("math_id", "full")]["error"]
        assert by[("math_hard", "full")]["status"] == "ok"


def test_two_ranks_resume_from_the_checkpoint_with_the_next_attempt(tmp_path) -> None:
    cfg = TrainConfig(**{**TINY, "checkpoint_every_steps": 4}, eval_every_steps=3, checkpoint_dir=str(tmp_path / "ckpt"))
    first, second = tmp_path / "first", tmp_path / "second"
    assert launch("resume-run", 2, 6, cfg, summary_dir=first, log_dir=tmp_path / "logs", timeout=300) == 0
    assert launch("resume-run", 2, 10, cfg, summary_dir=second, log_dir=tmp_path / "logs", timeout=300,
                  resume=True) == 0
    for before, after in zip(summaries(first, 2), summaries(second, 2)):
        assert (before["attempt"], before["steps"]) == (0, 6)
        assert (after["attempt"], after["start_step"], after["steps"]) == (1, 6, 10)
        assert after["eval_steps"] == [9, 10]  # the step trigger's baseline (6) came back with the checkpoint


SENT = Control((CommandEvent(run_id="r", command="scale_lr", args={"factor": 0.5, "from_step": 3, "restore_step": 2},
                             reason="reward fell", ts=1.0, event_id="c1"),
                CommandEvent(run_id="r", command="stop", target_node="n2", ts=2.0, event_id="c2")),
               time_due=True, checkpoint_due=False, now=12.5)


def _broadcast_control(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        got = Collective(2).broadcast_object(SENT if rank == 0 else Control())
        Path(out, f"control{rank}.pkl").write_bytes(pickle.dumps(got))
    finally:
        dist.destroy_process_group()


def test_rank_0s_commands_reach_every_rank_as_the_records_it_read(tmp_path) -> None:
    """The step's control goes to every rank as a `Control` of `CommandEvent`s (they pickle), not as dicts."""
    import torch.multiprocessing as mp

    mp.spawn(_broadcast_control, args=(f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2)
    for rank in (0, 1):
        got = pickle.loads((tmp_path / f"control{rank}.pkl").read_bytes())
        assert got == SENT and all(type(c) is CommandEvent for c in got.commands)
