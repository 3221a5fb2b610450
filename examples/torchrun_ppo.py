"""A small PPO loop under torchrun (gloo, CPU) that reports with `areal_metrics.init` alone.

    python -m torch.distributed.run --standalone --nproc-per-node 2 examples/torchrun_ppo.py --run-id ppo-demo

The task stands in for an LLM's: a prompt is a number x < 16, the right answer
is (3x + 1) mod 16, and the policy (embedding + linear layer) samples answers;
reward 1 when right. Each step every rank rolls out its own prompts (a group
of answers per prompt, GRPO-style advantages), takes a few clipped PPO epochs
with a KL penalty to the initial policy, and DDP averages the gradients.

What it reports: every rank logs its step (`run.log`, torch scalars as they
are); every evaluation round each rank evaluates the same 16 prompts greedily
and logs its verdicts (`run.log_eval`): the stream worker's cross-node vote
turns the ranks' results into one consensus. `am.CommandApplier` applies the control
topic's commands: rank 0 reads them (`run.commands()`) and broadcasts them, so every rank
evaluates, changes its interval or learning rate (`scale_lr` from its `from_step`), and stops
at the same step, and each rank acknowledges what it applied.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import areal_metrics as am

K = 16  # prompts and answers


def right_answer(x: torch.Tensor) -> torch.Tensor:
    return (3 * x + 1) % K


class Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(K, 32)
        self.head = torch.nn.Linear(32, K)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))  # logits over the answers


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-id", default=None, help="default: AREAL_RUN_ID, else torchrun's rendezvous id")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8, help="prompts per rank and step")
    p.add_argument("--group", type=int, default=4, help="answers sampled per prompt")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--rollout-delay", type=float, default=0.0,
                   help="seconds each rollout waits, as if an LLM were generating")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def ppo_step(policy: torch.nn.Module, reference: torch.nn.Module, optimizer: torch.optim.Optimizer,
             gen: torch.Generator, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """One rollout and a few clipped PPO epochs; returns the step's statistics (0-d tensors)."""
    prompts = torch.randint(0, K, (args.prompts,), generator=gen).repeat_interleave(args.group)
    with torch.no_grad():
        old_logp = F.log_softmax(policy(prompts), dim=-1)
        answers = torch.multinomial(old_logp.exp(), 1, generator=gen).squeeze(1)
        ref_logp = F.log_softmax(reference(prompts), dim=-1).gather(1, answers[:, None]).squeeze(1)
    time.sleep(args.rollout_delay)
    rewards = (answers == right_answer(prompts)).float()
    grouped = rewards.view(args.prompts, args.group)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).flatten()
    old = old_logp.gather(1, answers[:, None]).squeeze(1)
    for _ in range(2):
        logp_all = F.log_softmax(policy(prompts), dim=-1)
        logp = logp_all.gather(1, answers[:, None]).squeeze(1)
        ratio = (logp - old).exp()
        clipped = ratio.clamp(0.8, 1.2)
        kl = ((ref_logp - logp).exp() - (ref_logp - logp) - 1).mean()  # k3 estimator
        entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
        loss = -torch.min(ratio * advantages, clipped * advantages).mean() + 0.02 * kl - 0.01 * entropy
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients over the ranks
        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        optimizer.step()
    return {"reward": rewards.mean(), "reward_std": rewards.std(), "kl": kl.detach(), "entropy": entropy.detach(),
            "clip_ratio": ((ratio - 1).abs() > 0.2).float().mean(), "loss": loss.detach(), "grad_norm": grad_norm,
            "advantage_mean": advantages.mean()}


def evaluate(policy: torch.nn.Module) -> tuple[list[int], list[dict[str, object]]]:
    """Greedy answers to every prompt: the same prompts on every rank, so the ranks can vote."""
    prompts = torch.arange(K)
    with torch.no_grad():
        answers = policy(prompts).argmax(-1)
    verdicts = (answers == right_answer(prompts)).int().tolist()
    samples = [{"prompt": f"(3*{x}+1) mod {K} =", "response": str(int(a)), "verdict": v}
               for x, a, v in zip(prompts.tolist(), answers.tolist(), verdicts)]
    return verdicts, samples


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)  # the same initial policy on every rank
    model = Policy()
    reference = Policy()
    reference.load_state_dict(model.state_dict())
    policy = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(policy.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)  # each rank its own prompts

    # rank, world size, local rank and node come from torchrun's environment
    run = am.init(run_id=args.run_id, config=vars(args), tags=["example", "torchrun"], framework="torch")
    # the commands, applied at the same step on every rank (rank 0 reads them and broadcasts them);
    # each rank acknowledges what it applied
    control = am.CommandApplier(run, optimizer)
    if rank == 0:
        control.submit(run.commands())  # starts the control consumer (it reads from the run's start)
    if rank == 0:
        print(f"ready {run.run_id} world {world}", flush=True)
    interval, step, rounds = args.eval_every, 0, 0
    for step in range(args.steps):
        started = time.perf_counter()
        stats = ppo_step(policy, reference, optimizer, gen, args)
        run.log({**stats, "lr": optimizer.param_groups[0]["lr"], "n_samples": args.prompts * args.group,
                 "latency_ms": (time.perf_counter() - started) * 1000, "epoch": step / 20}, step=step)
        due = control.at_step(step + 1)  # before the next update: scale_lr from its from_step, the flags
        evaluate_now, stop = due.evaluate, due.stop
        interval = due.eval_interval or interval
        if evaluate_now or (step + 1) % interval == 0:
            verdicts, samples = evaluate(model)
            run.log_eval(f"modular-{K}", step, verdicts=verdicts, samples=samples)  # eval_id: the same on every rank
            rounds += 1
            if rank == 0:
                print(f"eval {step} {'command' if evaluate_now else 'schedule'}", flush=True)
        if stop:
            break
    run.finish()
    if rank == 0:
        print(f"done {step} rounds {rounds}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
