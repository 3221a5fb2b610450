"""`demo`: the main job, end to end on this machine.

1. build the policy's supervised warm start if it is not cached yet (once);
2. start the local stack (Kafka broker, stream worker, ClickHouse sink) with the
   demo's stream settings;
3. train, side by side (`run_configs`):
   - the compared runs: mt4-grpo (up to 4 attempts with feedback) and mt2-grpo
     (up to 2), `--seeds` seeds each, `--nproc` ranks each, the same evaluation
     sets and the same closed-loop settings (`LOOP`, in each run's
     `config.eval_loop`), no fault injection;
   - the vote run: 3 ranks, sharded at 2 replicas a sample (each rank evaluates two
     thirds of the set) with the third rank adjudicating the samples its two replicas
     dispute; one rank a systematically faulty replica (`dissent_rank`, `dissent_kind`
     "stuck": its grader returns 0 for every sample; outvoted by the adjudication and
     named) and one round failing
     on every rank (degraded mode: the last good result repeated, stale, with
     an alert);
   - the regression run: RL on every weight at a rate too high for that on purpose
     (`REGRESSION`), so accuracy really drops; the loop's `scale_lr` cuts the lr by ten
     and restores the weights of the round before the drop, and accuracy comes back;
   the compared and regression runs evaluate the full set every round in the
   training process; the vote run in a process per rank on weight snapshots,
   two-stage and sharded;
4. time short runs one after the other: 1, 2 and 4 ranks (throughput across rank counts), then
   untrained policies of three widths at 1 rank (throughput across model sizes);
5. wait until the sink has stored every step, print what happened from SQL
   (and the checks the demo stands for) and write the report figures.

The stack keeps running afterwards, with its data, for `sql`, `report`,
`compare`, `alerts` and `watch`; `areal-metrics down` stops it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from areal_metrics.commands import demo_sql
from areal_metrics.errors import UserError

STRATEGIES = {"mt4-grpo": 4, "mt2-grpo": 2}
# The worker's settings for the demo's runs: the closed loop on evaluation, a short window.
STREAMS = {"defaults": {"window": 10, "min_eval_interval": 5, "interval_dwell_steps": 20, "step_wait_s": 20.0,
                        "lr_eval_threshold": 0.12, "lr_eval_dataset": "math_hard", "lr_apply_delay_steps": 2,
                        "no_improvement_rounds": 2, "vote_timeout_s": 60.0, "stall_seconds": 120.0}}


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--steps", type=int, default=40, help="training steps per run (default 40)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks per compared run and of the lr run (default 1; the vote run has 3)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per strategy (default 3)")
    parser.add_argument("--scaling-steps", type=int, default=4,
                        help="steps of each 1-, 2- and 4-rank throughput run (default 4; 0: none)")
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="JSON or TOML trainer settings applied to every run (see areal_train/config.py)")
    parser.add_argument("--out", type=Path, default=Path("reports/demo"), help="where the report PNGs go")
    parser.add_argument("--no-watch", action="store_true",
                        help="no live view: the runs' status, reward and accuracy as lines every 10 s")


DEMO_TRAINING = {"batch_prompts": 4, "group_size": 4, "eval_mode": "async", "eval_every_steps": 8,
                 "eval_cpu_share": 0.5, "checkpoint_every_steps": None, "tags": ["demo"]}
# The closed loop of every compared run and of the regression run: the same settings, so that the
# compared runs differ only by strategy and seed. It cuts the learning rate when the in-distribution
# consensus is shown to be below the threshold 0.10 (the warm start reads 0.158 there, and a run that
# learns rises: only a drop to about 0.07 or less on 512 samples is evidence, docs/WORKLOAD.md).
# A cut is by ten and rolls back to the round before the drop: a lower lr alone does not bring back a
# policy that collapsed (docs/WORKLOAD.md, the probe with --cut-at and --rollback).
LOOP = {"enabled": True, "dataset": "math_id", "stage": "full", "threshold": 0.10, "alpha": 0.05,
        "patience_rounds": 0, "factor": 0.1, "min_factor": 0.01, "rollback": True}
# The regression run: RL on every weight (rl_parameters ".") at a rate far too high for that
# (the probe: math_id 0.11 -> 0.02-0.04 within 8 steps, docs/WORKLOAD.md), the compared runs' loop.
REGRESSION = {"rl_parameters": ".", "lr": 1e-3}
VOTE_RANKS = 3
VOTE_REPLICAS = 2  # sharded: shard_nodes 3 > replicas 2, the third rank adjudicating disputed samples


def run_configs(args: argparse.Namespace, stamp: str) -> dict[str, tuple[int, object]]:
    """run id -> (ranks, TrainConfig): the compared runs, the vote run and the regression run.

    The compared runs and the regression run evaluate the full set every round (one stage, in the
    training process: 8 runs share 2 cores anyway), so that each has a full-stage round every
    `eval_every_steps` for its slope and its loop; the vote run keeps the two-stage gate, async.

    The demo's settings first, then --config's (a key the file sets wins)."""
    from areal_metrics.areal_train.config import ConfigError, load

    def config(**changes: object) -> object:
        try:
            base = load(args.config)
            overrides = {k: v for k, v in DEMO_TRAINING.items() if args.config is None or k not in _keys(args.config)}
            return base.replace(**{**overrides, **changes})
        except ConfigError as exc:
            raise UserError(str(exc)) from None

    runs: dict[str, tuple[int, object]] = {}
    for strategy, turns in STRATEGIES.items():
        for seed in range(1, args.seeds + 1):
            runs[f"demo-{stamp}-{strategy}-s{seed}"] = (args.nproc, config(
                seed=seed, max_turns=turns, group=strategy, eval_loop=LOOP, two_stage=False, eval_mode="sync"))
    faulty = VOTE_RANKS - 1
    runs[f"demo-{stamp}-vote"] = (VOTE_RANKS, config(
        seed=101, max_turns=STRATEGIES["mt4-grpo"], group="vote", tags=["demo", "faults"],
        eval_redundancy=VOTE_REPLICAS, dissent_rank=faulty, dissent_kind="stuck", fail_eval_rounds=[3],
        eval_loop={"enabled": False}))
    runs[f"demo-{stamp}-lr-high"] = (args.nproc, config(
        seed=102, max_turns=STRATEGIES["mt4-grpo"], group="lr-regression", tags=["demo", "lr-regression"],
        eval_loop=LOOP, two_stage=False, eval_mode="sync", **REGRESSION))
    return runs


def compared_runs(runs: dict[str, tuple[int, object]]) -> dict[str, list[str]]:
    """group -> run ids of the compared strategies (what `areal-metrics compare` takes)."""
    return {g: [r for r, (_, cfg) in runs.items() if cfg.group == g] for g in STRATEGIES}  # type: ignore[attr-defined]


def _keys(path: Path) -> set[str]:
    """The settings a config file sets (they win over the demo's own)."""
    import tomllib

    text = path.read_text(encoding="utf-8")
    data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    return set(data) if isinstance(data, dict) else set()


def run(args: argparse.Namespace) -> int:
    if args.steps < 10:
        raise UserError(f"--steps: must be >= 10 (got {args.steps})")
    if not 1 <= args.nproc <= 8:
        raise UserError(f"--nproc: must be in 1..8 (got {args.nproc})")
    if not 1 <= args.seeds <= 4:
        raise UserError(f"--seeds: must be in 1..4 (got {args.seeds})")
    import os

    from areal_metrics.stack import services as stack
    from areal_metrics.areal_train.launch import prepare, start
    from areal_metrics.producers.contract.settings import Settings, state_dir

    started = time.monotonic()
    stamp = time.strftime("%H%M%S")
    runs = run_configs(args, stamp)
    prepare(next(iter(runs.values()))[1])  # the warm start, built once and cached
    streams_config = state_dir() / "demo-streams.json"
    streams_config.parent.mkdir(parents=True, exist_ok=True)
    streams_config.write_text(json.dumps(STREAMS, indent=2))
    os.environ["AREAL_STREAMS_CONFIG"] = str(streams_config)
    print("starting the local stack (Kafka broker, stream worker, sink) ...", flush=True)
    try:
        info, fresh = stack.up()
    except (RuntimeError, TimeoutError) as exc:
        raise UserError(str(exc)) from None
    print(f"stack up: kafka {info.kafka_version} at {info.kafka_bootstrap}, store {info.clickhouse_url}")
    if not fresh:
        print("note: the stack was already running; its stream worker keeps the settings it started with "
              f"(the demo's are in {streams_config}; `areal-metrics down` first to use them)", file=sys.stderr)
    env = stack.service_env(info)
    settings = Settings.from_env()
    logs = state_dir() / "logs"
    handles = [start(run_id, nproc, args.steps, cfg, env=env, log_dir=logs)  # type: ignore[arg-type]
               for run_id, (nproc, cfg) in runs.items()]
    print(f"training {len(runs)} runs ({', '.join(runs)}), {args.steps} steps each; "
          f"logs in {logs}", flush=True)
    _follow(handles, settings, list(runs), args.no_watch, started)
    codes = [h.wait() for h in handles]
    if any(codes):
        raise UserError(f"a training run failed (exit status {codes}); see {logs}")
    scaling = _scaling_runs(args, stamp, env, logs)
    every = [*runs, *scaling]
    expected = sum(n for n, _ in runs.values()) * args.steps + sum(n * args.scaling_steps for n in scaling.values())
    stored = _wait_for_sink(settings, every, expected)
    demo_sql.print_summary(settings, list(runs))
    paths = _write_report(args.out, every)
    groups = " ".join(compared_runs(runs))
    print(f"\ndone in {time.monotonic() - started:.0f} s ({stored} step events stored). The stack is still up:")
    print(f"  .venv/bin/areal-metrics compare {groups} --dataset math_id")
    print('  .venv/bin/areal-metrics sql "SELECT run_id, count() FROM v_steps GROUP BY run_id"')
    print("  .venv/bin/areal-metrics alerts        .venv/bin/areal-metrics down")
    return 0 if paths else 1


PLAIN_EVERY_S = 10.0  # the live view without a terminal: the runs' lines this often


def _follow(handles: list, settings: object, runs: list[str], no_watch: bool, started: float) -> None:
    def finished() -> bool:
        return all(h.poll() is not None for h in handles)

    from areal_metrics.commands.watch import watch_loop

    try:
        # without a terminal (or with --no-watch) the same content as lines, every 10 s
        plain = no_watch or not sys.stdout.isatty()
        watch_loop(settings, runs, until=finished, plain_every_s=PLAIN_EVERY_S if plain else None)
    except KeyboardInterrupt:
        for h in handles:
            h.terminate()
        raise


# The model-size sweep of figure 3: policy widths at 1 rank, untrained (no warm start to build per size).
SIZE_WIDTHS = (64, 128, 256)


def _scaling_runs(args: argparse.Namespace, stamp: str, env: dict[str, str], logs: Path) -> dict[str, int]:
    """Short runs one at a time: 1, 2 and 4 ranks of the demo's policy (throughput across rank counts), then
    policies of SIZE_WIDTHS at 1 rank (across model sizes); run id -> ranks."""
    from areal_metrics.areal_train.launch import start

    if args.scaling_steps <= 0:
        return {}
    model = next(iter(run_configs(args, stamp).values()))[1]
    quiet = model.replace(eval_at_start=False, eval_every_steps=None, eval_at_end=False, group="throughput",  # type: ignore[attr-defined]
                          tags=["demo", "scaling"], fail_eval_rounds=[], max_turns=1, eval_loop={"enabled": False})
    sweep = [(f"demo-{stamp}-tput-{n}r", n, quiet) for n in (1, 2, 4)]
    sweep += [(f"demo-{stamp}-size-{width}", 1, quiet.replace(d_model=width, warmstart_steps=0,  # type: ignore[attr-defined]
                                                               tags=["demo", "model_size"]))
              for width in SIZE_WIDTHS]
    out = {}
    for run_id, nproc, config in sweep:
        print(f"throughput: {run_id} ({nproc} rank{'s' if nproc > 1 else ''}, {args.scaling_steps} steps)", flush=True)
        code = start(run_id, nproc, args.scaling_steps, config, env=env, log_dir=logs).wait(600)
        if code:
            raise UserError(f"throughput run {run_id} failed (exit status {code}); see {logs}")
        out[run_id] = nproc
    return out


def _wait_for_sink(settings: object, runs: list[str], expected: int, timeout: float = 120.0) -> int:
    """Every rank publishes one step event per step: wait until the sink stored them all."""
    from areal_metrics.sinks.query import StoreError, connect

    deadline = time.monotonic() + timeout
    stored = 0
    while time.monotonic() < deadline:
        try:
            with connect(settings) as store:  # type: ignore[arg-type]
                stored = int(store.command(
                    "SELECT count() FROM v_steps WHERE run_id IN {runs:Array(String)}", {"runs": runs}))
        except StoreError:
            stored = 0
        if stored >= expected:
            return stored
        time.sleep(1)
    raise UserError(f"the sink stored {stored} of {expected} step events within {timeout:.0f} s")


def _write_report(out: Path, runs: list[str]) -> list[Path]:
    from areal_metrics.analysis.report import write_report

    # the strategies over their seeds with a 95 % t-interval; figure 1 with pass@k, maj@k and greedy accuracy
    paths = write_report(out, runs, grouped=True, eval_details=True)
    print("report figures: " + ", ".join(str(p) for p in paths))
    return paths
