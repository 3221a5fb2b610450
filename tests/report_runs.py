"""Runs for the report's legibility tests, built as events (the sink's own path loads them):

- `demo_like()`: what `make demo` stores: 3 seeds of two strategies (1 rank each), a 3-rank vote run with
  a stale round, a regression run cut by the loop (`scale_lr` with a rollback), 1-, 2- and 4-rank
  throughput runs of 4 steps (tag `scaling`); two evaluation sets with pass@4, maj@4 and greedy accuracy
  and the grader's error counts; the workload's `reward_label` in each run's config.
- `user_run()`: a plain user's run, as `am.init` stores it: two ranks on one host, a reward and a
  throughput, one evaluation set without a response length, no stream worker (no consensus), no label.
"""

from __future__ import annotations

import math

from areal_metrics.producers.contract.events import (
    CommandEvent,
    EvalConsensusEvent,
    EvalEvent,
    Event,
    RewardSmoothedEvent,
    RunEvent,
    StepEvent,
)

T0 = 1_700_000_000
DEMO_LABEL = "reward (right answers, discounted per extra attempt)"
ERRORS = ("arithmetic", "carry", "format", "off_by_one", "truncated")
USER_RUN = "my-first-run"


def _evals(run: str, ranks: int, step: int, dataset: str, acc: float, length: float | None, *, stale: bool = False,
           consensus: bool = True, metrics: bool = True) -> list[Event]:
    eval_id = f"{run}:{step}:{dataset}:full"
    wrong = round(64 * (1 - acc))
    errors = {f"errors.{k}": float(wrong * (i + 1 + step % 3) // 15) for i, k in enumerate(ERRORS)}
    out: list[Event] = [EvalEvent(run_id=run, rank=r, node=f"node-{r}", eval_id=eval_id, step=step, dataset=dataset,
                                  accuracy=acc, response_length=length, n_samples=64, metrics=errors,
                                  ts=T0 + step * 10 + 5) for r in range(ranks)]
    if consensus:
        details = {"pass@4": min(1.0, acc * 2.2), "maj@4": acc * 1.1, "greedy_accuracy": acc * 0.9} if metrics else {}
        out.append(EvalConsensusEvent(run_id=run, eval_id=eval_id, step=step, dataset=dataset, accuracy=acc,
                                      response_length=length, votes=ranks, replicas=ranks, agreement=1.0,
                                      stale=stale, n_samples=64, metrics=details, ts=T0 + step * 10 + 6))
    return out


def _run(run: str, group: str, ranks: int, config: dict, steps: int, *, level: float, slope: float,
         datasets: tuple[str, ...] = ("math_hard", "math_id"), every: int = 8, stale_step: int | None = None,
         tput: float = 600.0) -> list[Event]:
    events: list[Event] = [RunEvent(run_id=run, rank=r, node=f"node-{r}", status="running", config=config,
                                    group=group, world_size=ranks, tags=tuple(config.get("tags", ())), ts=T0)
                           for r in range(ranks)]
    for s in range(steps):
        reward = level + slope * s + 0.03 * math.sin(s + len(run))
        for r in range(ranks):
            events.append(StepEvent(run_id=run, rank=r, node=f"node-{r}", step=s, epoch=0.0, reward=reward,
                                    tokens=400 + 10 * r, throughput=tput + 20 * math.cos(s + r), world_size=ranks,
                                    n_samples=16, ts=T0 + s * 10))
        events.append(RewardSmoothedEvent(run_id=run, step=s, reward=reward, window=10, sliding_avg=reward,
                                          ema=reward, slope=slope, ts=T0 + s * 10 + 1))
    for s in range(0, steps + 1, every) if datasets else ():
        for d, dataset in enumerate(datasets):
            acc = min(0.9, max(0.01, level * 0.5 + slope * s * (1 + d) + 0.01 * len(run) % 3))
            events += _evals(run, ranks, s, dataset, acc, 30.0 + s * 0.3, stale=s == stale_step)
    return events


def demo_like() -> list[Event]:
    events: list[Event] = []
    for strategy, turns in (("mt4-grpo", 4), ("mt2-grpo", 2)):
        for seed in (1, 2, 3):
            config = {"tags": ["demo"], "strategy": strategy, "seed": seed, "max_turns": turns, "lr": 1e-4,
                      "reward_label": DEMO_LABEL}
            events += _run(f"demo-{strategy}-s{seed}", strategy, 1, config, 40, level=0.2 + 0.02 * seed,
                           slope=0.004 if turns == 4 else 0.002)
    events += _run("demo-vote", "vote", 3, {"tags": ["demo", "faults"], "seed": 101, "reward_label": DEMO_LABEL},
                   40, level=0.25, slope=0.003, stale_step=24, every=12)  # its own rounds: 12 and 36 hold one run
    events += _run("demo-lr-high", "lr-regression", 1,
                   {"tags": ["demo", "lr-regression"], "seed": 102, "lr": 1e-3, "reward_label": DEMO_LABEL},
                   40, level=0.2, slope=-0.002)
    events.append(CommandEvent(run_id="demo-lr-high", command="scale_lr", ts=T0 + 170,
                               args={"factor": 0.1, "from_step": 18, "restore_step": 8}))
    for ranks in (1, 2, 4):
        events += _run(f"demo-tput-{ranks}r", "throughput", ranks,
                       {"tags": ["demo", "scaling"], "reward_label": DEMO_LABEL}, 4, level=0.2, slope=0.0,
                       datasets=(), tput=1500.0 / ranks)
    return events


def user_run() -> list[Event]:
    events: list[Event] = [RunEvent(run_id=USER_RUN, rank=r, node="laptop", status="running", config={"lr": 3e-5},
                                    world_size=2, ts=T0) for r in (0, 1)]
    for s in range(30):
        for r in (0, 1):
            events.append(StepEvent(run_id=USER_RUN, rank=r, node="laptop", step=s, epoch=0.0,
                                    reward=1.5 + 0.05 * s + 0.1 * r, throughput=900.0 + 30 * r, world_size=2,
                                    ts=T0 + s * 10))
    for s in (0, 10, 20):
        events += _evals(USER_RUN, 2, s, "gsm8k", 0.3 + 0.01 * s, None, consensus=False)
    return events
