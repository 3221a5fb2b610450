"""Client benchmark: the caller's cost of `run.log` with a 100-key step, beside the alternatives.

    python -m benchmarks.bench_client [--steps N] [--json PATH]

All on the caller's thread, the same 100 values per step (16 that map to
typed columns, TRL/verl names among them, and 84 extra metrics), in one run:

- `run.log(values, step)`: plain Python floats (what frameworks hand over
  after `.item()`), and the same step as numpy scalars and 0-d torch tensors:
  all 2,000 steps' 100,000 of them made before the timed loop (about 80 MB,
  read from far caches, as after a step's backward pass), and beside it each
  step's made just before its `log`, untimed (`client_log_numpy_torch_fresh_us_p50`);
- building a validated `StepEvent` and `Publisher.publish` (the path the
  client's fast path avoids);
- `wandb.log(values, step=...)` in offline mode (when wandb is installed);
- TensorBoard's `SummaryWriter.add_scalar`, once per value.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import measure_and_report, print_table, summary

TYPED = ("reward", "reward_std", "kl", "entropy", "clip_ratio/region_mean", "completions/mean_length", "learning_rate",
         "grad_norm", "loss", "step_time", "critic/score/mean", "actor/pg_clipfrac", "perf/throughput", "tokens",
         "advantage_mean", "advantage_std")
EXTRA = tuple(f"train/extra_{i:02d}" for i in range(100 - len(TYPED)))


def step_values(step: int) -> dict[str, float]:
    base = 0.001 * (step % 1000)
    values = {name: 0.1 + base + i * 1e-3 for i, name in enumerate(TYPED + EXTRA)}
    values["tokens"] = 4096.0
    values["clip_ratio/region_mean"] = 0.05
    values["actor/pg_clipfrac"] = 0.04
    return values


def _timed(calls: int, fn: Any) -> list[float]:
    clock = time.perf_counter_ns
    costs = []
    for i in range(calls):
        t0 = clock()
        fn(i)
        costs.append((clock() - t0) / 1000)
    return costs


def _timed_fresh(calls: int, make: Any, fn: Any) -> list[float]:
    """Like _timed, with each call's argument made just before it, outside the timed part."""
    clock = time.perf_counter_ns
    costs = []
    for i in range(calls):
        arg = make(i)
        t0 = clock()
        fn(i, arg)
        costs.append((clock() - t0) / 1000)
    return costs


def numpy_torch(values: dict[str, float]) -> dict[str, Any]:
    """The step as a framework hands it over: every other value a numpy float32, the rest 0-d tensors."""
    import numpy as np
    import torch

    return {k: (np.float32(v) if j % 2 else torch.tensor(v)) for j, (k, v) in enumerate(values.items())}


def bench_client(bootstrap: str, steps: int) -> dict[str, float]:
    from areal_metrics.producers.client.run import init

    prefix = f"benchc{uuid.uuid4().hex[:6]}."
    with tempfile.TemporaryDirectory() as tmp:
        run = init(run_id="bench-client", kafka_bootstrap=bootstrap, topic_prefix=prefix, journal_dir=tmp, git=False,
                   rank=0, world_size=1)
        prepared = [step_values(i) for i in range(steps)]
        run.log(prepared[0], step=0)  # connect first
        run._publisher.flush(60)
        plain = _timed(steps, lambda i: run.log(prepared[i], step=i + 1))
        n_mixed = min(steps, 2000)
        made_before = [numpy_torch(p) for p in prepared[:n_mixed]]
        run._publisher.flush(60)  # each loop starts with the sender idle
        mixed = _timed(n_mixed, lambda i: run.log(made_before[i], step=steps + 1 + i))
        run._publisher.flush(60)
        fresh = _timed_fresh(n_mixed, lambda i: numpy_torch(prepared[i]),
                             lambda i, values: run.log(values, step=steps + 1 + n_mixed + i))
        delivered = run._publisher.flush(300)
        stats = run.stats()
        run.finish()
    assert delivered and stats.journaled == 0, stats
    p, m, f = summary(plain), summary(mixed), summary(fresh)
    return {"client_log_us_p50": p["p50"], "client_log_us_p99": p["p99"],
            "client_log_numpy_torch_us_p50": m["p50"], "client_log_numpy_torch_us_p99": m["p99"],
            "client_log_numpy_torch_fresh_us_p50": f["p50"], "client_log_numpy_torch_fresh_us_p99": f["p99"]}


def bench_validated(bootstrap: str, steps: int) -> dict[str, float]:
    """A validated StepEvent per step, then publish(): what a caller paid before the client."""
    from areal_metrics.producers.contract.events import StepEvent
    from areal_metrics.producers.delivery.publisher import Publisher
    from areal_metrics.producers.contract.topics import Topics

    with tempfile.TemporaryDirectory() as tmp:
        publisher = Publisher(bootstrap, Topics(f"benchv{uuid.uuid4().hex[:6]}."), Path(tmp))
        prepared = [step_values(i) for i in range(steps)]

        def one(i: int) -> None:
            v = prepared[i]
            publisher.publish(StepEvent(run_id="bench-validated", step=i, epoch=0, reward=v["reward"], kl=v["kl"],
                                        metrics={k: x for k, x in v.items() if k not in ("reward", "kl")}))

        costs = _timed(steps, one)
        publisher.close(60)
    s = summary(costs)
    return {"validated_step_us_p50": s["p50"], "validated_step_us_p99": s["p99"]}


def bench_wandb(steps: int) -> dict[str, float]:
    try:
        import wandb
    except ImportError:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(mode="offline", dir=tmp, project="areal-bench", settings=wandb.Settings(console="off"))
        prepared = [step_values(i) for i in range(steps)]
        costs = _timed(steps, lambda i: run.log(prepared[i], step=i))
        run.finish()
    s = summary(costs)
    return {"wandb_log_us_p50": s["p50"], "wandb_log_us_p99": s["p99"]}


def bench_tensorboard(steps: int) -> dict[str, float]:
    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as tmp:
        writer = SummaryWriter(tmp)
        prepared = [step_values(i) for i in range(steps)]

        def one(i: int) -> None:
            for name, value in prepared[i].items():
                writer.add_scalar(name, value, i)

        costs = _timed(steps, one)
        writer.close()
    s = summary(costs)
    return {"tensorboard_100_us_p50": s["p50"], "tensorboard_100_us_p99": s["p99"]}


def run(bootstrap: str, steps: int) -> dict[str, float]:
    logging.getLogger("areal_metrics.client").setLevel(logging.ERROR)
    out: dict[str, float] = {}
    out.update(bench_client(bootstrap, steps))
    out.update(bench_validated(bootstrap, min(steps, 2000)))
    out.update(bench_wandb(min(steps, 2000)))
    out.update(bench_tensorboard(min(steps, 2000)))
    return out


def report(r: dict[str, float]) -> None:
    ours = r["client_log_us_p50"]
    rows = [("run.log(), Python floats p50 / p99", f"{ours:.1f} / {r['client_log_us_p99']:.1f} us", "1.00 (ours)"),
            ("run.log(), numpy and torch scalars p50 / p99",
             f"{r['client_log_numpy_torch_us_p50']:.1f} / {r['client_log_numpy_torch_us_p99']:.1f} us",
             f"{r['client_log_numpy_torch_us_p50'] / ours:.1f}x (reads each tensor)"),
            ("  the same, each step's made just before its log p50 / p99",
             f"{r['client_log_numpy_torch_fresh_us_p50']:.1f} / {r['client_log_numpy_torch_fresh_us_p99']:.1f} us",
             f"{r['client_log_numpy_torch_fresh_us_p50'] / ours:.1f}x"),
            ("validated StepEvent + publish() p50 / p99",
             f"{r['validated_step_us_p50']:.1f} / {r['validated_step_us_p99']:.1f} us",
             f"{r['validated_step_us_p50'] / ours:.1f}x")]
    if "wandb_log_us_p50" in r:
        rows.append(("wandb.log() offline p50 / p99", f"{r['wandb_log_us_p50']:.1f} / {r['wandb_log_us_p99']:.1f} us",
                     f"{r['wandb_log_us_p50'] / ours:.1f}x"))
    rows.append(("TensorBoard add_scalar x100 p50 / p99",
                 f"{r['tensorboard_100_us_p50']:.1f} / {r['tensorboard_100_us_p99']:.1f} us",
                 f"{r['tensorboard_100_us_p50'] / ours:.1f}x"))
    print_table("client: caller's cost per logged step (100 keys)", rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    return measure_and_report(lambda bootstrap: run(bootstrap, args.steps), report, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
