"""One rank's training state: built fresh or restored from the last checkpoint, and saved.

Fresh: the warm-started policy (rank 0 builds the cached warm start if it is
missing, the others wait), rank 0's weights everywhere, the evaluation sets
built on the head and broadcast. Restored (`resume`): the model, optimizer,
schedulers, quick-stage memory, learning-rate scale and counters from the
checkpoint's shared part, the RNG states and data cursor from this rank's
part, and `attempt` one more than the checkpoint's.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from areal_metrics.areal_train import checkpoint, warmstart
from areal_metrics.areal_train.collective import Collective
from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.control import Control
from areal_metrics.areal_train.data import TrainData
from areal_metrics.areal_train.eval_process import Standby
from areal_metrics.areal_train.evalsets import EvalSet
from areal_metrics.areal_train.evaluation import Outcome, TwoStage
from areal_metrics.areal_train.evaluator import Evaluator
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.ppo import PPOSettings
from areal_metrics.areal_train.scheduler import EvalScheduler, Trigger
from areal_metrics.areal_train.task import (
    DATASETS,
    EVAL_EXCLUDE_SIZE,
    EVAL_SEED,
    Problem,
    eval_prompts,
    make_eval_set,
    make_train_set,
)
from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.events import CommandEvent, event_from_dict

log = logging.getLogger("areal_train")


# Rounds whose weights a rollback may restore. The loop names the latest round shown good, which a
# slide through rounds neither good nor cut puts 2-4 rounds back (tests/loop_simulation.py).
KEPT_ROUNDS = 5
HANDLED_KEPT = 4096  # ids of handled commands a checkpoint keeps (as the client's CommandApplier)
# what this workload's reward is (episodes.py): the report's reward axis reads the run config's `reward_label`
REWARD_LABEL = "reward (right answers, discounted per extra attempt)"


def checkpoint_root(cfg: TrainConfig, home: Path | None) -> Path:
    """Where checkpoints go: the config's checkpoint_dir, else `checkpoints/` in the state folder `home`
    (AREAL_HOME, which the process's entry point reads and passes in)."""
    if cfg.checkpoint_dir:
        return Path(cfg.checkpoint_dir)
    if home is None:
        raise ValueError("checkpoint_dir: the config names no folder and no state folder (AREAL_HOME) was given")
    return home / "checkpoints"


def build_eval_sets(cfg: TrainConfig) -> dict[str, EvalSet]:
    return {name: EvalSet(name, tuple(make_eval_set(name, cfg.eval_size)), k=cfg.eval_samples,
                          temperature=cfg.eval_temperature, attempt_len=cfg.max_response_len,
                          seed=EVAL_SEED + DATASETS.index(name), turns=cfg.eval_turns or cfg.max_turns)
            for name in cfg.eval_datasets}


@dataclass
class Session:
    cfg: TrainConfig
    run_id: str
    rank: int
    world_size: int
    device: torch.device
    comm: Collective
    clock: Callable[[], float]
    policy: Policy
    optimizer: torch.optim.Optimizer
    data: TrainData
    eval_sets: dict[str, EvalSet]
    eval_schedule: EvalScheduler
    checkpoint_schedule: Trigger
    sampler: torch.Generator
    reference: Policy | None = None
    ppo: PPOSettings = field(default_factory=PPOSettings)
    step: int = 0
    start_step: int = 0
    attempt: int = 0
    lr_scale: float = 1.0
    commands_applied: int = 0
    rollbacks: int = 0  # rounds' weights restored by a scale_lr's restore_step
    rounds: int = 0
    control: Control = field(default_factory=Control)  # this step's broadcast from rank 0
    waiting: list[CommandEvent] = field(default_factory=list)  # scale_lr commands for a later step boundary
    handled: list[str] = field(default_factory=list)  # ids of the commands applied or ignored (the last 4,096)
    commands_since: float | None = None  # when the run's first attempt started reading commands (the feed's time)
    kept: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # step -> weights of a recent round
    evaluator: Evaluator = field(init=False)
    _eval_memory: dict[str, Any] = field(default_factory=dict)
    home: Path | None = None  # the state folder (AREAL_HOME): checkpoints/ when the config names no checkpoint_dir

    # ------------------------------------------------------------ building

    @classmethod
    def open(cls, cfg: TrainConfig, run_id: str, rank: int, world_size: int, device: torch.device,
             comm: Collective, clock: Callable[[], float], resume: bool, warmstarts: Path,
             home: Path | None = None) -> Session:
        """`warmstarts`: the warm starts' cache folder; `home`: the state folder (both from the entry point)."""
        if resume or cfg.checkpoint_every_steps or cfg.checkpoint_every_seconds:
            checkpoint_root(cfg, home)  # no folder for the checkpoints: said now, not at the first checkpoint
        policy = _initial_policy(cfg, comm, rank, resume, warmstarts).to(device)
        now = clock()
        exclude = eval_prompts({name: EVAL_EXCLUDE_SIZE for name in DATASETS})
        session = cls(
            cfg=cfg, run_id=run_id, rank=rank, world_size=world_size, device=device, comm=comm, clock=clock,
            policy=policy, optimizer=torch.optim.Adam(rl_parameters(policy, cfg.rl_parameters), lr=cfg.lr),
            data=TrainData(make_train_set(cfg.train_size, cfg.seed, exclude), cfg.seed, rank, world_size),
            eval_sets=_shared_eval_sets(cfg, comm, rank),
            eval_schedule=cfg.eval_schedule(now),
            checkpoint_schedule=Trigger(every_steps=cfg.checkpoint_every_steps,
                                        every_seconds=cfg.checkpoint_every_seconds, start_time=now),
            sampler=torch.Generator().manual_seed(cfg.seed * 1000 + rank + 1),  # each rank its own samples
            reference=_frozen_copy(policy) if cfg.kl_coef > 0 else None,
            ppo=PPOSettings(clip_eps=cfg.clip_eps, entropy_coef=cfg.entropy_coef, kl_coef=cfg.kl_coef,
                            value_coef=cfg.value_coef, max_grad_norm=cfg.max_grad_norm, epochs=cfg.ppo_epochs,
                            minibatches=cfg.ppo_minibatches, temperature=cfg.temperature),
            home=home)
        if resume:
            session._restore(checkpoint.load_latest(checkpoint_root(cfg, home), run_id, rank, world_size, device))
        return session

    def start_evaluator(self, on_outcome: Callable[[Outcome], None], standby: Standby | None = None) -> None:
        cfg = self.cfg
        self.evaluator = Evaluator(
            self.eval_sets, on_outcome, {"d_model": cfg.d_model, "layers": cfg.layers, "heads": cfg.heads},
            self.device, asynchronous=cfg.eval_mode == "async",
            rule=TwoStage(alpha=cfg.quick_alpha, max_skipped=cfg.full_max_skipped), threads=cfg.eval_threads,
            cpu_share=cfg.eval_cpu_share, max_pending=cfg.eval_max_pending, memory=dict(self._eval_memory),
            start_early=cfg.evaluates_on_schedule, standby=standby)

    # ------------------------------------------------------------ checks

    def check_eval_data(self) -> dict[str, str]:
        """Compare the fingerprints of the evaluation sets across ranks: dataset -> why it fails."""
        mine = {name: s.fingerprint() for name, s in self.eval_sets.items()}
        everyone = self.comm.all_gather_object(mine)
        out = {}
        for name in mine:
            held = [fps.get(name) for fps in everyone]
            if len(set(held)) > 1:
                detail = ", ".join(f"rank {r} holds {fp}" for r, fp in enumerate(held))
                out[name] = f"dataset fingerprint mismatch on {name}: {detail}"
        return out

    def remember(self, event_ids: Iterable[str]) -> None:
        """Commands handled: a resumed attempt that reads the control topic again leaves them out."""
        self.handled.extend(event_ids)
        del self.handled[:-HANDLED_KEPT]

    # ------------------------------------------------------------ rollback

    def keep_weights(self, step: int) -> None:
        """Keep the weights an evaluation round measured, for a `scale_lr` that restores them (the last few).
        They are kept in host memory: a GPU holds one policy, not six."""
        self.kept[step] = {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}
        for old in sorted(self.kept)[:-KEPT_ROUNDS]:
            del self.kept[old]

    def restore_weights(self, step: int) -> bool:
        """The weights of round `step` back in the policy, Adam's moments cleared; False when not kept."""
        weights = self.kept.get(step)
        if weights is None:
            return False
        self.policy.load_state_dict(weights)
        self.optimizer.state.clear()  # the moments belong to the weights left behind
        return True

    # ------------------------------------------------------------ checkpoints

    def save(self) -> Path:
        now = self.clock()
        shared = None
        if self.rank == 0:
            def shared() -> dict[str, Any]:
                return {"policy": self.policy.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "reference": self.reference.state_dict() if self.reference is not None else None,
                        "eval_schedule": self.eval_schedule.state_dict(now),
                        "checkpoint_schedule": self.checkpoint_schedule.state_dict(now),
                        "eval_memory": dict(self.evaluator.memory), "lr_scale": self.lr_scale,
                        "commands_applied": self.commands_applied, "rounds": self.rounds,
                        "waiting": [c.to_dict() for c in self.waiting], "handled": list(self.handled),
                        "commands_since": self.commands_since}
        own = {"sampler": self.sampler.get_state(), "torch": torch.get_rng_state(), "python": random.getstate(),
               "data": self.data.state_dict()}
        meta = {"run_id": self.run_id, "attempt": self.attempt, "world_size": self.world_size,
                "config": self.cfg.to_dict()}
        path = checkpoint.save(checkpoint_root(self.cfg, self.home), self.run_id, self.step, self.rank, shared=shared, own=own,
                               meta=meta, barrier=self.comm.barrier)
        if self.rank == 0:
            log.info("%s: checkpoint at step %d in %s", self.run_id, self.step, path)
        return path

    def _restore(self, loaded: checkpoint.Loaded) -> None:
        shared, own, now = loaded.shared, loaded.own, self.clock()
        self.policy.load_state_dict(shared["policy"])
        self.optimizer.load_state_dict(shared["optimizer"])
        if self.reference is not None and shared["reference"] is not None:
            self.reference.load_state_dict(shared["reference"])
        self.eval_schedule.load_state_dict(shared["eval_schedule"], now)
        self.checkpoint_schedule.load_state_dict(shared["checkpoint_schedule"], now)
        self._eval_memory = dict(shared["eval_memory"])
        self.lr_scale, self.commands_applied, self.rounds = shared["lr_scale"], shared["commands_applied"], shared["rounds"]
        self.waiting = [event_from_dict(c, CommandEvent) for c in shared["waiting"]]
        self.handled = list(shared.get("handled", ()))  # a checkpoint from before they were kept: none
        self.commands_since = shared.get("commands_since")
        self.sampler.set_state(own["sampler"])
        torch.set_rng_state(own["torch"])
        random.setstate(own["python"])
        self.data.load_state_dict(own["data"])
        self.step = self.start_step = int(loaded.meta["step"])
        self.attempt = int(loaded.meta["attempt"]) + 1

    def run_config(self, steps: int) -> dict[str, Any]:
        """The config the run event carries: the settings, the strategy and what the trainer decided."""
        interval = self.eval_schedule.every_steps  # the stream worker's base interval (CONTRACT.md additions)
        return {**self.cfg.to_dict(), "strategy": self.cfg.strategy, "steps": steps, "total_steps": steps,
                "reward_label": REWARD_LABEL,
                "n_parameters": self.policy.n_parameters(),
                **({"eval_interval_steps": interval} if interval else {}),
                "resumed_from_step": self.start_step if self.attempt else None,
                "dataset_fingerprints": {name: s.fingerprint() for name, s in self.eval_sets.items()}}


def rl_parameters(policy: torch.nn.Module, pattern: str) -> list[torch.nn.Parameter]:
    """The parameters whose names match `pattern` (TrainConfig.rl_parameters): what RL updates.
    The others are frozen, so the backward pass stops where nothing trained lies below it."""
    trained = []
    for name, parameter in policy.named_parameters():
        parameter.requires_grad_(re.search(pattern, name) is not None)
        if parameter.requires_grad:
            trained.append(parameter)
    if not trained:
        raise ConfigError(f"rl_parameters: {pattern!r} names no parameter of the policy")
    return trained


def _initial_policy(cfg: TrainConfig, comm: Collective, rank: int, resume: bool, warmstarts: Path) -> Policy:
    torch.manual_seed(cfg.seed)
    if cfg.warmstart_steps > 0 and not resume:
        spec = warmstart.spec_for(cfg)
        if rank == 0:
            warmstart.ensure(spec, cache=warmstarts)  # built once, cached; the other ranks wait at the barrier
        comm.barrier()
        policy = warmstart.load(spec, cache=warmstarts)
    else:
        policy = Policy(cfg.d_model, cfg.layers, cfg.heads)  # a resumed run's weights come from the checkpoint
    comm.broadcast_module_(policy)  # rank 0's weights, to be sure
    return policy


def _frozen_copy(policy: Policy) -> Policy:
    """The reference policy for the KL term: the weights training starts from, frozen."""
    import copy

    reference = copy.deepcopy(policy)
    reference.requires_grad_(False)
    return reference


def _shared_eval_sets(cfg: TrainConfig, comm: Collective, rank: int) -> dict[str, EvalSet]:
    """Built on the data-parallel head and broadcast, so every rank holds the same samples."""
    sets = comm.broadcast_object(build_eval_sets(cfg) if rank == 0 else None)
    if cfg.corrupt_eval_rank == rank:  # injected: this rank's copy differs in one answer
        name, first = next(iter(sets.items()))
        problems = list(first.problems)
        p = problems[0]
        problems[0] = Problem(p.skill, p.level, p.prompt, p.answer + 1, p.scratch)
        sets[name] = EvalSet(name, tuple(problems), first.k, first.temperature, first.attempt_len, first.seed)
    return sets
