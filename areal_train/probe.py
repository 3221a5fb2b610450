"""Does RL learn? One process, the trainer's own pieces, no broker: the measurement docs/WORKLOAD.md cites.

Builds (or loads) a warm start, prints its diagnostic table, then runs GRPO
steps with `episodes.rollout`, `ppo.advantages` and `ppo.update` on one rank's
data, evaluating both held-out sets every `--every` steps (`--eval-size`
prompts x `--eval-k` samples at temperature 1, seeded: the same samples every
round). At the end: each set's first and last accuracy and the t statistic of
an OLS slope over the rounds. `--supervised` trains the warm start's own loss on
the worked solutions instead (as many problems a step as RL has episodes): the
most that many right answers could teach, to hold RL's numbers against.

    python -m areal_metrics.areal_train.probe --steps 60 --batch-prompts 16 --group-size 16 --lr 3e-4
"""

from __future__ import annotations

import argparse
import re
import math
import random
import sys
import time

import torch

from areal_metrics.areal_train import ppo, warmstart
from areal_metrics.areal_train.data import TrainData
from areal_metrics.areal_train.diagnose import answer_all, diagnose, table
from areal_metrics.areal_train.episodes import rollout
from areal_metrics.areal_train.task import (
    DATASETS,
    EVAL_EXCLUDE_SIZE,
    Problem,
    VOCAB_SIZE,
    eval_prompts,
    make_eval_set,
    make_train_set,
)
from areal_metrics.areal_train.trainer import episode_metrics
from areal_metrics.areal_train.learning import ols_slope_t
from areal_metrics.areal_train.warmstart_cache import WarmStartSpec


def supervised_step(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, problems: list[Problem],
                    rng: random.Random, max_grad_norm: float) -> float:
    """One step of the warm start's loss on the worked solutions of `problems` (no retries); its loss."""
    policy.train()
    examples = [warmstart.example(p, rng, scratch_share=1.0, retry_share=0.0) for p in problems]
    loss = warmstart.supervised_loss(policy, *warmstart.batch_tensors(examples))
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(policy.parameters(), max_grad_norm)
    optimizer.step()
    return float(loss.detach())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m areal_metrics.areal_train.probe")
    ap.add_argument("--ws-steps", type=int, default=WarmStartSpec.steps)
    ap.add_argument("--ws-scratch-share", type=float, default=WarmStartSpec.scratch_share,
                    help="the warm start's share of examples written with the scratchpad")
    ap.add_argument("--ws-second-guess", type=float, default=WarmStartSpec.second_guess_share,
                    help="warm start: share of examples with a second, wrong answer after the first")
    ap.add_argument("--ws-label-smoothing", type=float, default=WarmStartSpec.label_smoothing,
                    help="warm start: label smoothing of its supervised loss (a flatter policy)")
    ap.add_argument("--train-only", default="", help="train only the parameters whose names match this regex")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-prompts", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--max-turns", type=int, default=1)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--eval-size", type=int, default=128)
    ap.add_argument("--eval-k", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=ppo.PPOSettings.epochs, help="PPO passes over each batch")
    ap.add_argument("--minibatches", type=int, default=ppo.PPOSettings.minibatches)
    ap.add_argument("--clip", type=float, default=ppo.PPOSettings.clip_eps)
    ap.add_argument("--entropy", type=float, default=ppo.PPOSettings.entropy_coef, help="entropy bonus")
    ap.add_argument("--cut-at", type=int, default=None, help="from this step on, lr x --cut-factor (a scale_lr)")
    ap.add_argument("--cut-factor", type=float, default=0.25)
    ap.add_argument("--rollback", action="store_true",
                    help="with --cut-at: also restore the weights of the round before the last one (a scale_lr's restore_step)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--supervised", action="store_true",
                    help="instead of RL, the warm start's supervised loss on the worked solutions of as many distinct "
                         "problems per step as RL has episodes: what that many right answers could teach at best")
    ap.add_argument("--diagnose", type=int, default=256, help="prompts per set of the diagnostic (0: none)")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from areal_metrics.areal_train.settings import TrainerSettings

    policy = warmstart.load(WarmStartSpec(steps=a.ws_steps, scratch_share=a.ws_scratch_share,
                                         second_guess_share=a.ws_second_guess,
                                         label_smoothing=a.ws_label_smoothing),
                            cache=TrainerSettings.from_env().warmstart_dir())
    print(f"warm start {policy.n_parameters():,} parameters", flush=True)
    if a.diagnose:
        print(table(diagnose(policy, size=a.diagnose, k=8), 8), flush=True)
    sets = {d: make_eval_set(d, a.eval_size) for d in DATASETS}

    def evaluate() -> dict[str, float]:
        return {d: sum(sum(v.samples) for v in vs) / (len(vs) * a.eval_k)
                for d, vs in ((d, answer_all(policy, ps, a.eval_k, 28, seed=777)) for d, ps in sets.items())}

    exclude = eval_prompts({n: EVAL_EXCLUDE_SIZE for n in DATASETS})
    data = TrainData(make_train_set(4096, a.seed, exclude), a.seed, 0, 1)
    trained = [t for n, t in policy.named_parameters() if re.search(a.train_only, n)]
    optimizer = torch.optim.Adam(trained, lr=a.lr)
    generator = torch.Generator().manual_seed(a.seed)
    settings = ppo.PPOSettings(clip_eps=a.clip, epochs=a.epochs, minibatches=a.minibatches, entropy_coef=a.entropy)
    examples_rng = random.Random(a.seed)
    rounds = [(0, evaluate())]
    kept = {0: {k: v.clone() for k, v in policy.state_dict().items()}}  # the weights of each round, for --rollback
    print(f"step 0: {rounds[-1][1]}", flush=True)
    started = time.process_time()
    for step in range(1, a.steps + 1):
        if step == a.cut_at:
            for group in optimizer.param_groups:
                group["lr"] = a.lr * a.cut_factor
            if a.rollback:
                restored = sorted(kept)[-2] if len(kept) > 1 else 0  # the round before the one that saw the drop
                policy.load_state_dict(kept[restored])
                optimizer.state.clear()  # Adam's moments belong to the weights left behind
                print(f"step {step}: weights of step {restored} restored", flush=True)
        if a.supervised:
            loss = supervised_step(policy, optimizer, data.next_batch(a.batch_prompts * a.group_size), examples_rng,
                                   settings.max_grad_norm)
            if step % a.every == 0:
                rounds.append((step, evaluate()))
                print(f"step {step}: supervised loss {loss:.3f} eval {rounds[-1][1]} "
                      f"({time.process_time() - started:.0f} s CPU)", flush=True)
            continue
        problems = [p for p in data.next_batch(a.batch_prompts) for _ in range(a.group_size)]
        noise = torch.rand(len(problems), a.max_turns * 29, VOCAB_SIZE, generator=generator)
        policy.eval()
        episodes = rollout(policy, problems, max_turns=a.max_turns, attempt_len=28, noise=noise)
        reward = torch.tensor(episodes.rewards(0.9))
        advantage, returns = ppo.advantages(episodes, reward, a.group_size, "grpo", policy, 1.0, 0.95)
        policy.train()
        stats = ppo.update(policy, optimizer, episodes, advantage, returns, None, settings, None)
        scratch = episode_metrics(episodes)["scratchpad_share"]
        if step % a.every == 0:
            rounds.append((step, evaluate()))
            kept[step] = {k: v.clone() for k, v in policy.state_dict().items()}
            print(f"step {step}: reward {float(reward.mean()):.3f} scratchpad {scratch:.2f} "
                  f"entropy {stats.entropy:.3f} eval {rounds[-1][1]} ({time.process_time() - started:.0f} s CPU)",
                  flush=True)
    for d in DATASETS:
        xs, ys = [float(s) for s, _ in rounds], [r[d] for _, r in rounds]
        print(f"{d}: {ys[0]:.3f} -> {ys[-1]:.3f} (rise {ys[-1] - ys[0]:+.3f}), OLS slope t {ols_slope_t(xs, ys):.2f} "
              f"over {len(xs)} rounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
