"""AReaL's learning rate under `scale_lr`: `apply_commands(actor, run)` (no broker).

What is AReaL's own (areal 1.0.4 from PyPI): the schedule, `areal.engine.fsdp_utils.
get_cosine_schedule_with_warmup` with `min_lr_ratio` (what `FSDPEngine.create_optimizer` builds for
`lr_scheduler_type="cosine"`, over the `torch.optim.AdamW` it builds), and the actor's
`step_lr_scheduler`, `areal.api.engine_api.TrainEngine.step_lr_scheduler` (the alias
`PPOTrainer.train` calls once per global step after `ppo_update`). What is not: the engine itself
(`FSDPPPOActor` needs peft, FSDP and a model; not importable here), so the actor is a small class
with those two attributes and AReaL's method, and `lr_scheduler_step` is `FSDPEngine`'s one line
(`self.lr_scheduler.step()`). The loop is `PPOTrainer.train`'s order: the update (whose reported `lr`
is `lr_scheduler.get_last_lr()[0]`, as `FSDPEngine.optimizer_step` reports it), then
`step_lr_scheduler()`.
"""

from __future__ import annotations

import pytest
import torch
from areal.api.engine_api import TrainEngine
from areal.engine.fsdp_utils import get_cosine_schedule_with_warmup

from areal_metrics.integrations.areal import NO_HOOK, apply_commands
from tests.test_client_commands import Feed, command

STEPS = 14


class Actor:
    """An SPMD actor's parts that `apply_commands` uses: AReaL's schedule and step alias."""

    step_lr_scheduler = TrainEngine.step_lr_scheduler

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.0)
        self.lr_scheduler = get_cosine_schedule_with_warmup(self.optimizer, 3, STEPS, min_lr_ratio=0.1)

    def lr_scheduler_step(self) -> None:  # FSDPEngine.lr_scheduler_step
        self.lr_scheduler.step()


def train(actor: Actor) -> dict[int, float]:
    lrs = {}
    for global_step in range(STEPS):  # PPOTrainer.train: 0-based global steps
        x = torch.randn(8, 4)
        actor.optimizer.zero_grad()
        actor.model(x).pow(2).mean().backward()
        actor.optimizer.step()
        lrs[global_step] = actor.lr_scheduler.get_last_lr()[0]  # what optimizer_step reports as lr
        assert actor.optimizer.param_groups[0]["lr"] == pytest.approx(lrs[global_step], rel=1e-12)
        actor.step_lr_scheduler()
    return lrs


def test_scale_lr_reaches_areals_cosine_schedule_from_its_step_and_the_rest_is_acknowledged_as_ignored() -> None:
    base = train(Actor())
    assert min(base.values()) < max(base.values())
    actor = Actor()
    feed = Feed({2: [command("scale_lr", factor=0.5, from_step=6), command("evaluate_now"), command("stop")]})
    applier = apply_commands(actor, feed)
    assert applier is not None
    lrs = train(actor)
    for step, lr in base.items():
        assert lrs[step] == pytest.approx((0.5 if step >= 6 else 1.0) * lr, rel=1e-12, abs=0), step
    assert feed.acks == [("evaluate_now", "ignored", 3, 1.0, NO_HOOK["evaluate_now"]),
                         ("stop", "ignored", 3, 1.0, NO_HOOK["stop"]),
                         ("scale_lr", "applied", 6, 0.5, None)]  # the lr: from step 6 on


def test_an_actor_without_an_optimizer_here_gets_no_applier() -> None:
    class Controller:  # a single-controller launch: the engines live in remote workers
        def step_lr_scheduler(self) -> None: ...

    assert apply_commands(Controller(), Feed()) is None
