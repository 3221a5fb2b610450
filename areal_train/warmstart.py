"""The supervised warm start: about a thousand steps on generated worked solutions, cached on disk.

RL from random weights would not find a right multi-token answer within a
demonstration's few hundred steps, so training starts from a policy that has
seen solutions (as RL recipes start from an SFT model). The examples are
training problems only (never an evaluation prompt), written with the
scratchpad (`scratch_share` of them; the rest as the bare answer), and
`retry_share` of them as a retry: a wrong first attempt (not trained on), the
feedback token, then the worked solution. So the warm-started policy knows
what feedback means. The recipe (`WarmStartSpec`) is short on purpose: the
first run on a fresh machine builds it in about a minute of one core, and
what it leaves to learn is RL's (`areal-metrics train --diagnose` shows it).

The result is cached under `TrainerSettings.warmstart_dir()` (the entry point's) by a key of everything it depends
on; `ensure(spec)` builds it once (a file lock keeps concurrent processes
from building it twice) and returns the path.

    python -m areal_metrics.areal_train.warmstart [--steps N]   # build (or find) the default one
"""

from __future__ import annotations

import argparse
import fcntl
import math
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.task import (
    ANS,
    BOS,
    DATASETS,
    EOS,
    EVAL_EXCLUDE_SIZE,
    PAD_ID,
    WRONG,
    Problem,
    digits,
    encode,
    eval_prompts,
    make_train_set,
)
from areal_metrics.areal_train.warmstart_cache import WarmStartSpec, path_for, spec_for  # noqa: F401 (spec_for: for callers)

# ------------------------------------------------------------------ the data


def _wrong_answer(rng: random.Random, answer: int) -> int:
    for _ in range(10):
        wrong = answer + rng.choice((1, -1, 10, -10, 100, rng.randint(2, 30)))
        if wrong >= 0 and wrong != answer:
            return wrong
    return answer + 1


def example(problem: Problem, rng: random.Random, scratch_share: float = WarmStartSpec.scratch_share,
            retry_share: float = WarmStartSpec.retry_share,
            second_guess_share: float = WarmStartSpec.second_guess_share) -> tuple[list[str], list[bool]]:
    """(tokens, trained-on mask) of one supervised example; the mask marks the target tokens."""
    tokens = [BOS, *problem.prompt, ANS]
    target = [False] * len(tokens)
    if rng.random() < retry_share:  # a retry: a wrong attempt, the feedback, then the worked solution
        wrong = [*(problem.scratch if rng.random() < 0.5 else ()), "#", *digits(_wrong_answer(rng, problem.answer)), EOS]
        tokens += [*wrong, WRONG]
        target += [False] * (len(wrong) + 1)
        solution = problem.solution(with_scratch=True)
    else:
        solution = problem.solution(with_scratch=rng.random() < scratch_share)
    if second_guess_share and rng.random() < second_guess_share:  # "... # 73 # 75 <eos>": the grader reads 75
        solution = [*solution[:-1], "#", *digits(_wrong_answer(rng, problem.answer)), EOS]
    tokens += solution
    target += [True] * len(solution)
    return tokens, target


def batch_tensors(examples: list[tuple[list[str], list[bool]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, valid, target) [B, T], right-padded."""
    width = max(len(t) for t, _ in examples)
    ids = torch.full((len(examples), width), PAD_ID, dtype=torch.long)
    target = torch.zeros(len(examples), width, dtype=torch.bool)
    for i, (tokens, mask) in enumerate(examples):
        ids[i, : len(tokens)] = torch.tensor(encode(tokens))
        target[i, : len(mask)] = torch.tensor(mask)
    return ids, ids != PAD_ID, target


def batches_of(examples: list[tuple[list[str], list[bool]]], size: int) -> list[list[tuple[list[str], list[bool]]]]:
    """Consecutive batches of the (already random) examples: every batch mixes skills and levels.

    Batches of similar lengths pad less but hold one skill each, and the alternating
    gradients cost more than the padding saves: with them the recipe (then of distinct examples) ended at
    loss 0.47 and 0.034 sampled accuracy on math_id, mixed at 0.21 and 0.099 (docs/WORKLOAD.md)."""
    return [examples[i:i + size] for i in range(0, len(examples), size)]


# ------------------------------------------------------------------ training


def supervised_loss(policy: Policy, ids: torch.Tensor, valid: torch.Tensor, target: torch.Tensor,
                    label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy of the target tokens; with `label_smoothing` e, the target gets 1 - e and the
    writable tokens share e (a flatter policy: its samples stray where its argmax would not)."""
    hidden = policy(ids, valid)[:, :-1]
    log_probs = torch.log_softmax(policy.logits(hidden), dim=-1)
    logp = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    if label_smoothing:
        writable = policy.writable.float()
        spread = (log_probs * writable).sum(-1) / writable.sum()
        logp = (1 - label_smoothing) * logp + label_smoothing * spread
    mask = target[:, 1:].float()
    return -(logp * mask).sum() / mask.sum().clamp(min=1)


def problems_for(spec: WarmStartSpec) -> list[Problem]:
    """The recipe's problems, one per example: drawn with repeats, so every skill and level keeps its
    share of `spec.level_weights` (distinct draws exhaust the small ones: docs/WORKLOAD.md)."""
    exclude = eval_prompts({name: EVAL_EXCLUDE_SIZE for name in DATASETS})
    return make_train_set(spec.steps * spec.batch, spec.seed, exclude, spec.level_weights, distinct=False)


def build(spec: WarmStartSpec, log: bool = True) -> tuple[Policy, dict[str, float]]:
    torch.manual_seed(spec.seed)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)
    rng = random.Random(spec.seed)
    problems = problems_for(spec)
    policy = Policy(spec.d_model, spec.layers, spec.heads)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=spec.lr, weight_decay=0.01)
    warmup = max(spec.steps // 20, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min((i + 1) / warmup, 0.5 * (1 + math.cos(math.pi * min(i / spec.steps, 1.0)))))
    started, cpu_started, losses = time.perf_counter(), time.process_time(), []
    batches = batches_of([example(p, rng, spec.scratch_share, spec.retry_share, spec.second_guess_share)
                           for p in problems], spec.batch)
    try:
        for step, chunk in enumerate(batches):
            loss = supervised_loss(policy, *batch_tensors(chunk), spec.label_smoothing)
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(float(loss.detach()))
            if log and (step + 1) % 100 == 0:
                print(f"warm start: step {step + 1}/{spec.steps}, loss {sum(losses[-100:]) / 100:.3f}",
                      file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(previous_threads)
    tail = losses[-max(len(losses) // 10, 1):]
    return policy, {"loss_first": losses[0], "loss_last": sum(tail) / len(tail),
                    "seconds": time.perf_counter() - started, "cpu_seconds": time.process_time() - cpu_started}


def ensure(spec: WarmStartSpec, log: bool = True, *, cache: Path) -> Path:
    """The cached warm start for `spec` in the folder `cache`, built first if missing (once, under a file lock)."""
    path = path_for(spec, cache)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():  # another process built it while this one waited
            return path
        if log:
            print(f"building the supervised warm start ({spec.steps} steps, cached in {path.parent}) ...",
                  file=sys.stderr, flush=True)
        policy, info = build(spec, log)
        tmp = path.with_suffix(".tmp")
        torch.save({"spec": asdict(spec), "key": spec.key(), "info": info, "state_dict": policy.state_dict()}, tmp)
        os.replace(tmp, path)
        if log:
            print(f"warm start ready in {info['seconds']:.0f} s, {info['cpu_seconds']:.0f} s of CPU (loss {info['loss_first']:.2f} -> "
                  f"{info['loss_last']:.3f})", file=sys.stderr, flush=True)
    return path


def load(spec: WarmStartSpec, device: torch.device | str = "cpu", *, cache: Path) -> Policy:
    """The cached warm start of `spec` in `cache` (built first if missing); a file of another recipe is refused."""
    policy = Policy(spec.d_model, spec.layers, spec.heads)
    path = ensure(spec, cache=cache)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    found = saved.get("key")
    if found != spec.key():
        raise RuntimeError(f"{path}: a warm start of recipe {found} where {spec.key()} was asked for; "
                           "delete the file to rebuild it")
    policy.load_state_dict(saved["state_dict"])
    return policy.to(device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_metrics.areal_train.warmstart")
    parser.add_argument("--steps", type=int, default=WarmStartSpec.steps)
    args = parser.parse_args(argv)
    from areal_metrics.areal_train.settings import TrainerSettings

    print(ensure(WarmStartSpec(steps=args.steps), cache=TrainerSettings.from_env().warmstart_dir()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
