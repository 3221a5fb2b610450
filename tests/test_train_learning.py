"""The trainer really learns: seeded, with a generous bound."""

from __future__ import annotations

import torch

from areal_train.config import TrainConfig
from areal_train.metrics import choose_device
from areal_train.trainer import train
from producers.events import EvalEvent, StepEvent


def test_reward_on_the_easy_task_rises_clearly() -> None:
    events: list = []
    cfg = TrainConfig(seed=0, batch_prompts=32, eval_every_steps=None, two_stage=False, publish=False)
    summary = train(cfg, "learn", steps=200, publish=events.append)

    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == list(range(1, 201))
    first = sum(e.reward for e in steps[:20]) / 20
    last = sum(e.reward for e in steps[-20:]) / 20
    assert first < 0.15, first  # a random policy rarely writes the exact sum
    assert last > first + 0.3, (first, last)

    # greedy evaluation before the first update and after the last one agrees
    easy = {e.step: e.accuracy for e in events if isinstance(e, EvalEvent) and e.dataset == "add_1digit"}
    assert set(easy) == {0, 200}
    assert easy[200] > easy[0] + 0.3, easy
    assert summary.device == str(choose_device())  # CUDA where there is one, else CPU


def test_every_step_reports_the_metrics_and_cpu_memory() -> None:
    events: list = []
    cfg = TrainConfig(seed=1, eval_at_start=False, eval_every_steps=None, eval_at_end=False, advantage="gae")
    train(cfg, "metrics", steps=5, publish=events.append)
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert len(steps) == 5 and not [e for e in events if isinstance(e, EvalEvent)]
    for e in steps:
        for name in ("reward", "reward_std", "entropy", "advantage_mean", "advantage_std", "kl", "clip_ratio",
                     "loss", "lr", "grad_norm", "response_length", "tokens", "throughput", "latency_ms"):
            assert getattr(e, name) is not None, name
        assert e.tokens > 0 and e.throughput > 0 and e.entropy > 0
        if torch.cuda.is_available():  # CUDA: max allocated, in the contract field too
            assert e.gpu_mem_bytes is not None and e.gpu_mem_bytes == e.metrics["mem_bytes"] > 0
            assert e.metrics["cuda"] == 1.0
        else:  # CPU: the process RSS
            assert e.gpu_mem_bytes is None and e.metrics["mem_bytes"] > 10e6
            assert abs(e.metrics["rss_bytes"] - e.metrics["mem_bytes"]) < 50e6
    assert steps[-1].clip_ratio > 0 or steps[-1].kl > 0  # the second PPO epoch moves off the sampling policy
    assert torch.get_num_threads() == 1


def test_the_first_evaluation_sees_the_initial_weights_and_epochs_trigger() -> None:
    from areal_train.evaluation import evaluate_problems
    from areal_train.policy import Policy
    from areal_train.task import make_problems

    events: list = []
    cfg = TrainConfig(seed=5, eval_every_steps=None, eval_every_epochs=1, train_size=64, batch_prompts=16,
                      two_stage=False, eval_at_end=False, eval_size=32, lr=0.05)
    summary = train(cfg, "start", steps=8, publish=events.append)
    assert summary.eval_steps == [0, 4, 8]  # before training, then after each epoch of 64 / 16 = 4 steps

    torch.manual_seed(cfg.seed)  # the initial weights, as the trainer built them
    initial = Policy(hidden=cfg.hidden)
    problems = make_problems("add_1digit", cfg.eval_size, cfg.seed + 7919)
    device = choose_device()
    expected = evaluate_problems(initial.to(device), problems, cfg.max_response_len, device).verdicts
    at_start = [e for e in events if isinstance(e, EvalEvent) and e.step == 0 and e.dataset == "add_1digit"]
    later = [e for e in events if isinstance(e, EvalEvent) and e.step == 8 and e.dataset == "add_1digit"]
    assert list(at_start[0].verdicts) == expected
    assert later[0].verdicts != at_start[0].verdicts  # a large lr moved the weights by step 8
