"""PPO/GRPO on the math task, one process per rank. `train()` reads top to bottom.

Set up (warm-started policy, training data, evaluation sets from the head,
schedulers; or all of it from the last checkpoint on `resume`), then per
step: roll out episodes (one or several attempts each), reward them by the
grader, update with the clipped loss (gradients averaged over the ranks),
publish the step, sync the control commands, evaluate when a trigger is due
and checkpoint when the checkpoint trigger is. Collectives run on gloo; on
CUDA the gradients travel through CPU memory, simple and right for a model
this small.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from areal_metrics.areal_train import ppo
from areal_metrics.areal_train.collective import Collective
from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.control import STALE_STOP, Applied, Control, apply_commands, due, stale_stop
from areal_metrics.areal_train.episodes import Episodes, rollout
from areal_metrics.areal_train.eval_process import Standby
from areal_metrics.areal_train.evaluation import Outcome, RoundJob
from areal_metrics.areal_train.metrics import choose_device, memory_bytes, rss_bytes
from areal_metrics.areal_train.reporting import NullRun, Reporter, RunLike, RunSpec
from areal_metrics.areal_train.session import Session
from areal_metrics.areal_train.settings import TrainerSettings
from areal_metrics.areal_train.task import EOS
from areal_metrics.producers.contract.events import CommandEvent

log = logging.getLogger("areal_train")

RunFactory = Callable[[RunSpec], RunLike]  # opens this rank's run: the public client's `init` (worker.py)


@dataclass
class Summary:
    """What one rank did, for the launcher and tests."""

    rank: int
    steps: int  # the last step trained
    first_reward: float
    last_reward: float  # mean over the last 10% of this attempt's steps
    eval_steps: list[int]
    stopped_by_command: bool
    device: str
    seconds: float
    attempt: int = 0
    start_step: int = 0
    evals: list[dict[str, object]] = field(default_factory=list)  # dataset, stage, step, status, accuracy, ...


def node_name(rank: int) -> str:
    """Each rank is one replica of the evaluation vote, so each has its own node name."""
    return f"{socket.gethostname()}-r{rank}"


def train(cfg: TrainConfig, run_id: str, steps: int, rank: int = 0, world_size: int = 1,
          open_run: RunFactory | None = None, clock: Callable[[], float] = time.time,
          resume: bool = False, eval_standby: Standby | None = None, warmstarts: Path | None = None,
          home: Path | None = None) -> Summary:
    """Train `steps` steps (from the last checkpoint with `resume`), reporting through `open_run`'s run.

    `eval_standby`: an evaluation process forked by the entry point before any thread started, for
    `async` evaluation (without one, the evaluator spawns its process). `warmstarts`: the warm starts'
    cache folder (None: the default, ~/.cache/areal-metrics/warmstart); `home`: the state folder whose
    checkpoints/ take the checkpoints when the config names no checkpoint_dir. The entry point reads both
    (TrainerSettings, AREAL_HOME); nothing here reads the environment."""
    started = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    if cfg.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = choose_device(cfg.device)
    comm = Collective(world_size)
    if warmstarts is None:
        warmstarts = TrainerSettings().warmstart_dir()
    session = Session.open(cfg, run_id, rank, world_size, device, comm, clock, resume, warmstarts, home)
    spec = RunSpec(run_id, rank, world_size, session.attempt, node_name(rank), session.run_config(steps),
                   tuple(cfg.tags), cfg.group or cfg.strategy)
    run = open_run(spec) if open_run is not None else NullRun()  # sends the `running` run event
    if session.commands_since is None:  # a new run (or a checkpoint from before it was kept): this run's start
        since = getattr(run, "commands_since", None)
        session.commands_since = float(since) if isinstance(since, (int, float)) else None
    reporter = Reporter(run, run_id)
    summary = Summary(rank, session.step, 0.0, 0.0, [], False, str(device), 0.0, session.attempt, session.step)
    session.start_evaluator(_outcome_handler(reporter, summary), eval_standby)
    status = "failed"
    try:
        rewards = _loop(cfg, session, reporter, summary, run, comm, clock, steps)
        status = "finished"
    except KeyboardInterrupt:
        status = "killed"
        raise
    finally:
        session.evaluator.close()
        run.finish(status, 0 if status == "finished" else 1)
    tail = rewards[-max(len(rewards) // 10, 1):] if rewards else [0.0]
    summary.first_reward = rewards[0] if rewards else 0.0
    summary.last_reward = sum(tail) / len(tail)
    summary.seconds = time.perf_counter() - started
    return summary


def _outcome_handler(reporter: Reporter, summary: Summary) -> Callable[[Outcome], None]:
    def on_outcome(outcome: Outcome) -> None:
        reporter.evaluation(outcome)
        result = outcome.result
        summary.evals.append({"dataset": outcome.dataset, "stage": outcome.stage, "step": outcome.step,
                              "status": outcome.status, "error": outcome.error,
                              "accuracy": result.accuracy if result else None,
                              "n_samples": len(result.verdicts) if result else 0})
    return on_outcome


def _loop(cfg: TrainConfig, session: Session, reporter: Reporter, summary: Summary, run: RunLike,
          comm: Collective, clock: Callable[[], float], steps: int) -> list[float]:
    rewards: list[float] = []
    if session.eval_schedule.before_training():
        _evaluate(session, comm, 0, force="evaluation before training", summary=summary)
    step = session.step
    for step in range(session.step + 1, steps + 1):
        stats = _train_step(cfg, session, reporter, comm, step)
        rewards.append(stats)
        session.step = step
        rollbacks = session.rollbacks
        applied = _sync_commands(session, comm, run, clock, step)
        last = step == steps or applied.stop
        # weights restored by a scale_lr: a full round of them at once, before any update at the new rate, so
        # the loop and the run's readers see what the rollback brought back (not what the next updates did)
        restored = session.rollbacks > rollbacks
        reasons = session.eval_schedule.after_step(step, session.data.epoch, session.control.time_due,
                                                   session.control.now)
        if reasons or restored or (last and cfg.eval_at_end and (not summary.eval_steps or summary.eval_steps[-1] != step)):
            force = "end of training" if last else "weights restored" if restored else None
            _evaluate(session, comm, step, force=force, summary=summary)
        if session.checkpoint_schedule.fire(step, session.data.epoch, session.control.checkpoint_due,
                                            session.control.now) or last:
            session.save()
        session.evaluator.poll()
        if applied.stop:
            summary.stopped_by_command = True
            break
    summary.steps = step
    return rewards


def _train_step(cfg: TrainConfig, session: Session, reporter: Reporter, comm: Collective, step: int) -> float:
    began = time.perf_counter()
    policy, device = session.policy, session.device
    problems = [p for p in session.data.next_batch(cfg.batch_prompts) for _ in range(cfg.group_size)]
    budget = cfg.max_turns * (cfg.max_response_len + 1)
    noise = torch.rand(len(problems), budget, policy.tokens.num_embeddings, generator=session.sampler).to(device)
    policy.eval()
    episodes = rollout(policy, problems, max_turns=cfg.max_turns, attempt_len=cfg.max_response_len,
                       temperature=cfg.temperature, noise=noise, device=device)
    reward = torch.tensor(episodes.rewards(cfg.turn_discount), device=device)
    advantage, returns = ppo.advantages(episodes, reward, cfg.group_size, cfg.advantage, policy, cfg.gamma,
                                        cfg.gae_lambda)
    policy.train()
    for group in session.optimizer.param_groups:
        group["lr"] = cfg.lr * session.lr_scale
    stats = ppo.update(policy, session.optimizer, episodes, advantage, returns, session.reference, session.ppo,
                       comm.mean_ if comm.active else None)
    latency = time.perf_counter() - began
    generated = episodes.generated_tokens()
    mem = memory_bytes(device)
    fields = dict(reward=float(reward.mean()), reward_std=float(reward.std(unbiased=False)), entropy=stats.entropy,
                  advantage_mean=stats.advantage_mean, advantage_std=stats.advantage_std, kl=stats.kl,
                  clip_ratio=stats.clip_ratio, loss=stats.loss, lr=cfg.lr * session.lr_scale,
                  grad_norm=stats.grad_norm, response_length=generated / len(problems), tokens=generated,
                  throughput=generated / latency, latency_ms=latency * 1000,
                  gpu_mem_bytes=mem if device.type == "cuda" else None)
    metrics = {"mem_bytes": float(mem), "rss_bytes": float(rss_bytes()), "lr_scale": session.lr_scale,
               "commands_applied": float(session.commands_applied), "weights_restored": float(session.rollbacks),
               "eval_interval": float(session.eval_schedule.every_steps or 0), "cuda": float(device.type == "cuda"),
               **episode_metrics(episodes)}
    reporter.step(step, session.data.epochs, len(problems), fields, metrics)
    if session.rank == 0 and (step % 25 == 0 or step == session.start_step + 1):
        log.info("%s step %d reward %.3f (%.0f ms/step)", reporter.run_id, step, fields["reward"], latency * 1000)
    return fields["reward"]


def episode_metrics(episodes: Episodes) -> dict[str, float]:
    """What the episodes did: right at once or later, attempts, scratchpads, truncations."""
    n = max(len(episodes.grades), 1)
    firsts = [gs[0] for gs in episodes.grades if gs]
    scratch = sum(1 for a in episodes.attempts if a and a[0] and a[0][0] != "#") / n
    return {"first_attempt_accuracy": sum(g.correct for g in firsts) / n,
            "solved": sum(t is not None for t in episodes.solved_turn) / n,
            "attempts_mean": sum(len(gs) for gs in episodes.grades) / n,
            "scratchpad_share": scratch,
            "truncated_share": sum(1 for a in episodes.attempts for t in a if EOS not in t) / n}


def _sync_commands(session: Session, comm: Collective, run: RunLike, clock: Callable[[], float],
                   step: int) -> Applied:
    """Rank 0 hands over the commands that arrived (`Run.commands()`, never blocking) and whether the
    time triggers are due; every rank applies the same ones after the same step."""
    now = clock()
    session.control = comm.broadcast_object(Control(
        _arrived(session, run, step) if session.rank == 0 else (), session.eval_schedule.time_due(now),
        session.checkpoint_schedule.time_due(now), now))
    commands, session.waiting = due([*session.waiting, *session.control.commands], step)
    session.remember(c.event_id for c in commands)
    applied = apply_commands(commands, session.eval_schedule)
    restored = False
    if applied.restore_step is not None:
        restored = session.restore_weights(applied.restore_step)
        session.rollbacks += int(restored)
        log.info("rank %d step %d: weights of step %d %s", session.rank, step, applied.restore_step,
                 "restored" if restored else "not kept: not restored")
    if applied.count:
        session.commands_applied += applied.count
        session.lr_scale = max(session.lr_scale * applied.lr_factor, session.cfg.lr_min_scale)  # the floor
        log.info("rank %d step %d applied %s", session.rank, step, [c.command for c in commands])
        _acknowledge(run, commands, step + 1, session.lr_scale, applied.restore_step,
                     restored if applied.restore_step is not None else None)
    return applied


def _arrived(session: Session, run: RunLike, step: int) -> tuple[CommandEvent, ...]:
    """Rank 0's new commands. The feed reads from the run's first attempt's start (`commands_since`, kept in
    the checkpoint): a resumed attempt reads again what came after its checkpoint, whose lr and weights went
    with the attempt that crashed. What the checkpoint had handled or holds waiting is left out, and a `stop`
    sent before this attempt started is acknowledged as ignored (the resumed attempt goes on)."""
    read: Any = getattr(run, "commands")
    arrived = None
    if session.commands_since is not None:
        try:
            arrived = read(since=session.commands_since)
        except TypeError:  # a run of the caller's own: the commands as it gives them
            arrived = None
    known = set(session.handled) | {c.event_id for c in session.waiting}
    started = getattr(run, "started", None)
    fresh = []
    for command in (arrived if arrived is not None else read()):
        if command.event_id in known:
            continue
        if session.attempt > 0 and stale_stop(command, started):
            session.remember((command.event_id,))
            acknowledge = getattr(run, "acknowledge", None)
            if callable(acknowledge):
                acknowledge(command, "ignored", step=step + 1, detail=STALE_STOP)
            continue
        fresh.append(command)
    return tuple(fresh)


def _acknowledge(run: RunLike, commands: list[CommandEvent], step: int, lr_scale: float, restore_step: int | None,
                 restored: bool | None) -> None:
    """Each rank says what it applied (`command_ack`, from the first update the commands change)."""
    acknowledge = getattr(run, "acknowledge", None)
    if acknowledge is None:
        return
    for command in commands:
        detail = None
        if command.command == "scale_lr" and "restore_step" in command.args and restore_step is not None:
            detail = (f"weights of step {restore_step} restored" if restored
                      else f"factor alone: the weights of step {restore_step} were not kept")
        acknowledge(command, "applied", step=step, lr_factor=lr_scale, detail=detail)


def _evaluate(session: Session, comm: Collective, step: int, force: str | None, summary: Summary) -> None:
    """A round at this step on every rank: the data checked first, skipped while an evaluator is busy."""
    cfg = session.cfg
    summary.eval_steps.append(step)
    mismatch = session.check_eval_data()
    if force is not None:  # the first, the last and a restore's round are not skipped for a busy evaluator: wait
        session.evaluator.wait_idle(timeout=600)
    if comm.any(session.evaluator.busy()):
        why = "skipped: the evaluator is busy with an earlier round"
        for name, evalset in session.eval_sets.items():
            for stage in ("quick", "full") if cfg.two_stage else ("full",):
                session.evaluator.on_outcome(Outcome(step, name, stage, "skipped", evalset.fingerprint(), error=why))
        return
    session.rounds += 1  # rounds evaluated (a skipped one is not): what fail_eval_rounds counts
    job = RoundJob(step=step, round_no=session.rounds, rank=session.rank, world_size=session.world_size,
                   redundancy=cfg.eval_redundancy, quick_size=cfg.quick_size, two_stage=cfg.two_stage,
                   force_full=force, fail=step in cfg.fail_eval_at_steps or session.rounds in cfg.fail_eval_rounds,
                   dissent=cfg.dissent_rank == session.rank, dissent_kind=cfg.dissent_kind, mismatch=mismatch)
    session.evaluator.submit(session.policy, job)
    session.keep_weights(step)
