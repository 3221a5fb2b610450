"""PPO/GRPO on the addition task, one process per rank. Reads top to bottom.

`train()` is the whole algorithm: set up, build and share the evaluation
data, then per step: roll out, verify, compute advantages, update with the
clipped loss (gradients all-reduced over the ranks), publish the step's
metrics, sync the control commands and decide whether to evaluate.
Collectives run on gloo; on CUDA the gradients travel through CPU memory,
which is simple and correct for a model this small.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from areal_train import advantages as adv
from areal_train.config import TrainConfig
from areal_train.control import Applied, ControlListener, apply_commands
from areal_train.evaluation import Evaluator
from areal_train.metrics import choose_device, masked_mean, memory_bytes, rss_bytes
from areal_train.policy import Policy, encode_prompts
from areal_train.scheduler import EvalScheduler
from areal_train.task import Problem, decode_response, make_problems, verify
from producers.events import CommandEvent, Event, StepEvent, event_from_dict

log = logging.getLogger("areal_train")


@dataclass
class Summary:
    """What one rank did, for the launcher and tests."""

    rank: int
    steps: int
    first_reward: float
    last_reward: float  # mean over the last 10% of steps
    eval_steps: list[int]
    stopped_by_command: bool
    device: str
    seconds: float


def node_name(rank: int) -> str:
    """Each rank is one replica of the evaluation vote, so each has its own node name."""
    return f"{socket.gethostname()}-r{rank}"


def train(
    cfg: TrainConfig,
    run_id: str,
    steps: int,
    rank: int = 0,
    world_size: int = 1,
    publish: Callable[[Event], None] | None = None,
    listener_factory: Callable[[list[str]], ControlListener | None] | None = None,
    clock: Callable[[], float] = time.time,
) -> Summary:
    # ---------------------------------------------------------------- setup
    started = time.perf_counter()
    torch.set_num_threads(cfg.threads)
    distributed = world_size > 1
    if cfg.device != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    device = choose_device(cfg.device)
    node = node_name(rank)
    nodes = [node_name(r) for r in range(world_size)]
    publish = publish or (lambda event: None)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank ...
    policy = Policy(hidden=cfg.hidden).to(device)
    if distributed:  # ... and rank 0's, to be sure
        for p in policy.parameters():
            cpu = p.data.cpu()
            dist.broadcast(cpu, src=0)
            p.data.copy_(cpu)
    reference = Policy(hidden=cfg.hidden).to(device)  # frozen initial policy, for the KL term
    reference.load_state_dict(policy.state_dict())
    reference.requires_grad_(False)
    optimizer = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    lr_scale = 1.0
    sampler = torch.Generator(device=device).manual_seed(cfg.seed * 1000 + rank + 1)  # each rank its own samples

    # Training problems: every rank builds the same list and takes its own shard of each epoch.
    train_problems = make_problems(cfg.train_dataset, cfg.train_size, cfg.seed)
    shard_len = max(len(train_problems) // world_size, 1)
    epoch, cursor, order = 0, 0, _epoch_shard(len(train_problems), 0, cfg.seed, rank, world_size, shard_len)

    # Evaluation data: the head builds it and broadcasts it, so every node evaluates
    # exactly the same samples in the same order (the replicas of the vote).
    holder: list[object] = [None]
    if rank == 0:
        holder[0] = {name: [(p.a, p.b) for p in make_problems(name, cfg.eval_size, cfg.seed + 7919)]
                     for name in cfg.eval_datasets}
    if distributed:
        dist.broadcast_object_list(holder, src=0)
    eval_sets = {name: [Problem(a, b) for a, b in pairs] for name, pairs in holder[0].items()}  # type: ignore[union-attr]

    evaluator = Evaluator(publish, run_id, node, rank, world_size, eval_sets, cfg.max_response_len, device,
                          two_stage=cfg.two_stage, quick_size=cfg.quick_size, asynchronous=cfg.eval_mode == "async",
                          fail_at_steps=cfg.fail_eval_at_steps, fail_rounds=cfg.fail_eval_rounds,
                          dissent=cfg.dissent_rank == rank)
    scheduler = EvalScheduler(every_steps=cfg.eval_every_steps, every_epochs=cfg.eval_every_epochs,
                              every_seconds=cfg.eval_every_seconds, at_start=cfg.eval_at_start, start_time=clock())
    listener = listener_factory(nodes) if (rank == 0 and listener_factory) else None
    eval_steps: list[int] = []
    rewards: list[float] = []
    commands_applied = 0
    stopped = False

    # Evaluation before the first update: the weights are still the initial ones.
    if scheduler.before_training():
        evaluator.evaluate(policy, 0)
        eval_steps.append(0)

    # ---------------------------------------------------------------- the loop
    step = 0
    for step in range(1, steps + 1):
        step_started = time.perf_counter()

        # 1. prompts for this step from the rank's shard (an epoch ends when the shard is used up)
        batch: list[Problem] = []
        while len(batch) < cfg.batch_prompts:
            take = order[cursor:cursor + cfg.batch_prompts - len(batch)]
            batch += [train_problems[i] for i in take]
            cursor += len(take)
            if cursor == len(order):  # `epoch` counts completed epochs, as the step event reports it
                epoch += 1
                cursor, order = 0, _epoch_shard(len(train_problems), epoch, cfg.seed, rank, world_size, shard_len)
        problems = [p for p in batch for _ in range(cfg.group_size)]  # a group of answers per prompt
        prompts = encode_prompts(problems, device)

        # 2. rollout: sample answers with the current policy
        policy.eval()
        rollout = policy.generate(prompts, cfg.max_response_len, generator=sampler)
        mask = rollout.mask
        with torch.no_grad():
            ref_logprobs, _, _ = reference.score(prompts, rollout.actions)

        # 3. reward: 1 for an exactly right answer, from the verifier
        answers = [decode_response(a) for a in rollout.actions.tolist()]
        reward = torch.tensor([verify(p, a) for p, a in zip(problems, answers)], device=device)

        # 4. advantages: group-relative (GRPO), or GAE with the value head (PPO)
        if cfg.advantage == "grpo":
            advantages = adv.group_relative(reward, cfg.group_size).unsqueeze(1).expand_as(mask) * mask
            returns = None
        else:
            token_rewards = adv.terminal_rewards(reward, mask)
            advantages, returns = adv.gae(token_rewards, rollout.values, mask, cfg.gamma, cfg.gae_lambda)
            advantages = (advantages - masked_mean(advantages, mask)) * mask

        # 5. PPO update: clipped policy loss, entropy bonus, KL penalty; gradients averaged over the ranks
        policy.train()
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * lr_scale
        losses, clipped, entropy_first, kl_first, grad_norm = [], [], 0.0, 0.0, 0.0
        for ppo_epoch in range(cfg.ppo_epochs):
            logprobs, entropy, values = policy.score(prompts, rollout.actions)
            ratio = torch.exp(logprobs - rollout.logprobs)
            pg_loss = -torch.min(ratio * advantages, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * advantages)
            log_ratio_ref = ref_logprobs - logprobs
            kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1  # k3: unbiased, >= 0
            loss = masked_mean(pg_loss - cfg.entropy_coef * entropy + cfg.kl_coef * kl, mask)
            if returns is not None:
                loss = loss + cfg.value_coef * masked_mean((values - returns) ** 2, mask)
            optimizer.zero_grad(set_to_none=False)
            loss.backward()
            if distributed:
                _all_reduce_mean([p.grad for p in policy.parameters()], world_size)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm))
            optimizer.step()
            losses.append(float(loss.detach()))
            clipped.append(float(masked_mean(((ratio - 1).abs() > cfg.clip_eps).float(), mask)))
            if ppo_epoch == 0:
                entropy_first, kl_first = float(masked_mean(entropy, mask).detach()), float(masked_mean(kl, mask).detach())

        # 6. metrics of this step, published without waiting
        latency = time.perf_counter() - step_started
        n_tokens = int(prompts.numel() + mask.sum())
        token_adv = advantages[mask > 0]
        rewards.append(float(reward.mean()))
        mem = memory_bytes(device)
        publish(StepEvent(
            run_id=run_id, node=node, rank=rank, step=step, epoch=epoch,
            reward=float(reward.mean()), reward_std=float(reward.std(unbiased=False)),
            entropy=entropy_first, advantage_mean=float(token_adv.mean()),
            advantage_std=float(token_adv.std(unbiased=False)), kl=max(kl_first, 0.0),
            clip_ratio=min(max(sum(clipped) / len(clipped), 0.0), 1.0), loss=sum(losses) / len(losses),
            lr=cfg.lr * lr_scale, grad_norm=grad_norm if math.isfinite(grad_norm) else 0.0,
            response_length=float(mask.sum(dim=1).mean()), tokens=n_tokens, throughput=n_tokens / latency,
            latency_ms=latency * 1000, gpu_mem_bytes=mem if device.type == "cuda" else None,
            metrics={"mem_bytes": float(mem), "rss_bytes": float(rss_bytes()), "lr_scale": lr_scale, "commands_applied": float(commands_applied),
                     "eval_interval": float(scheduler.every_steps or 0), "cuda": float(device.type == "cuda")},
        ))
        if rank == 0 and (step % 50 == 0 or step == 1):
            log.info("%s step %d reward %.3f (%.1f ms/step)", run_id, step, rewards[-1], latency * 1000)

        # 7. control: rank 0 hands over the commands that arrived and says whether
        #    the time trigger is due; every rank applies the same at this step
        now = clock()
        payload = {"commands": [c.to_dict() for c in listener.drain()] if listener else [],
                   "time_due": scheduler.time_due(now), "now": now}
        if distributed:
            holder = [payload]
            dist.broadcast_object_list(holder, src=0)
            payload = holder[0]  # type: ignore[assignment]
        commands = [event_from_dict(c, CommandEvent) for c in payload["commands"]]  # type: ignore[union-attr]
        applied: Applied = apply_commands(commands, scheduler)  # type: ignore[arg-type]
        if applied.count:
            commands_applied += applied.count
            lr_scale *= applied.lr_factor
            log.info("%s rank %d step %d applied %s", run_id, rank, step, [c.command for c in commands])

        # 8. evaluation: any trigger that is due (step, epoch, agreed time, command), or the end
        reasons = scheduler.after_step(step, epoch, bool(payload["time_due"]), float(payload["now"]))  # type: ignore[arg-type]
        last = step == steps or applied.stop
        if reasons or (last and cfg.eval_at_end and (not eval_steps or eval_steps[-1] != step)):
            evaluator.evaluate(policy, step)
            eval_steps.append(step)
        if applied.stop:
            stopped = True
            break

    # ---------------------------------------------------------------- teardown
    evaluator.close()
    if listener is not None:
        listener.close()
    tail = rewards[-max(len(rewards) // 10, 1):] if rewards else [0.0]
    return Summary(rank=rank, steps=step, first_reward=rewards[0] if rewards else 0.0,
                   last_reward=sum(tail) / len(tail), eval_steps=eval_steps, stopped_by_command=stopped,
                   device=str(device), seconds=time.perf_counter() - started)


def _epoch_shard(n: int, epoch: int, seed: int, rank: int, world_size: int, shard_len: int) -> list[int]:
    """This rank's problem indices for one epoch: a seeded shuffle, dealt round-robin."""
    order = list(range(n))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order[rank::world_size][:shard_len]


def _all_reduce_mean(grads: list[torch.Tensor | None], world_size: int) -> None:
    """One all-reduce for all gradients (flattened; through CPU memory for gloo)."""
    present = [g for g in grads if g is not None]
    flat = torch.cat([g.reshape(-1) for g in present]).cpu()
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size
    offset = 0
    for g in present:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


