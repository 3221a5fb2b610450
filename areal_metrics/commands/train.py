"""`train`: run the distributed PPO/GRPO trainer as N local processes, publishing to Kafka."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from areal_metrics.errors import UserError
from areal_metrics.commands.arguments import seconds

_RUN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def add_arguments(parser: argparse.ArgumentParser, verb: str) -> None:
    parser.add_argument("--run-id", default=None, help="the run's id: 1..128 chars of [A-Za-z0-9._:-] (required to train)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks), default 2")
    parser.add_argument("--steps", type=int, default=300, help="training steps, default 300")
    parser.add_argument("--config", type=Path, default=None, metavar="FILE",
                        help="JSON or TOML file overriding the trainer defaults (see areal_train/config.py)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="write each rank's log to DIR/<run-id>-r<rank>.log instead of the terminal")
    parser.add_argument("--no-publish", action="store_true", help="train without publishing (no Kafka needed)")
    parser.add_argument("--timeout", type=seconds, default=None, help="stop the run after this many seconds")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run from its last checkpoint up to --steps (a new attempt)")
    parser.add_argument("--diagnose", action="store_true",
                        help="train nothing: print the warm start's greedy and sampled accuracy and pass@k per "
                             "skill and level (built first if not cached)")
    parser.add_argument("--diagnose-size", type=int, default=512, metavar="N",
                        help="--diagnose: held-out prompts per evaluation set (default 512)")
    parser.add_argument("--diagnose-k", type=int, default=8, metavar="K",
                        help="--diagnose: samples per prompt for the sampled accuracy and pass@K (default 8)")


def run(args: argparse.Namespace) -> int:
    if args.diagnose:
        return _diagnose(args)
    if args.run_id is None:
        raise UserError("--run-id: required to train (or --diagnose)")
    if not _RUN_ID.fullmatch(args.run_id):
        raise UserError(f"--run-id: {args.run_id!r} must be 1..128 chars of [A-Za-z0-9._:-]")
    if args.nproc < 1 or args.nproc > 64:
        raise UserError(f"--nproc: must be in 1..64 (got {args.nproc})")
    if args.steps < 1:
        raise UserError(f"--steps: must be >= 1 (got {args.steps})")

    from areal_metrics.areal_train.config import ConfigError, load
    from areal_metrics.areal_train.launch import launch

    try:
        cfg = load(args.config, **({"publish": False} if args.no_publish else {}))
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    if args.resume:
        _check_resumable(cfg, args)
    if cfg.publish:
        from areal_metrics.producers.contract.settings import Settings

        bootstrap = Settings.from_env().kafka_bootstrap
        if not _reachable(bootstrap):
            print(f"areal-metrics train: warning: no Kafka broker answers at {bootstrap}; events wait in the "
                  "journal until one does (start the stack with `areal-metrics up`)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="areal-train-") as summary_dir:
        try:
            code = launch(args.run_id, args.nproc, args.steps, cfg, log_dir=args.log_dir, summary_dir=summary_dir,
                          timeout=args.timeout, resume=args.resume)
        except TimeoutError as exc:
            raise UserError(str(exc)) from None
        for path in sorted(Path(summary_dir).glob("rank*.json")):
            s = json.loads(path.read_text())
            resumed = f" (attempt {s['attempt']}, resumed at step {s['start_step']})" if s["attempt"] else ""
            print(f"{args.run_id} rank {s['rank']}: {s['steps']} steps on {s['device']} in {s['seconds']:.1f} s{resumed}, "
                  f"reward {s['first_reward']:.3f} -> {s['last_reward']:.3f}, evaluations at steps {s['eval_steps']}"
                  + (" (stopped by command)" if s["stopped_by_command"] else ""))
    if code != 0:
        print(f"areal-metrics train: run {args.run_id} failed (exit status {code})", file=sys.stderr)
    return code


def _diagnose(args: argparse.Namespace) -> int:
    """The warm start a config asks for, per skill and level (areal_train/diagnose.py)."""
    from areal_metrics.areal_train.task import EVAL_EXCLUDE_SIZE

    if not 2 <= args.diagnose_size <= EVAL_EXCLUDE_SIZE:
        raise UserError(f"--diagnose-size: must be in 2..{EVAL_EXCLUDE_SIZE} (got {args.diagnose_size})")
    if not 1 <= args.diagnose_k <= 64:
        raise UserError(f"--diagnose-k: must be in 1..64 (got {args.diagnose_k})")
    from areal_metrics.areal_train.config import ConfigError, load

    try:
        cfg = load(args.config)
    except ConfigError as exc:
        raise UserError(str(exc)) from None
    if cfg.warmstart_steps == 0:
        raise UserError("--diagnose: the config has no warm start (warmstart_steps = 0)")
    import torch

    from areal_metrics.areal_train import warmstart
    from areal_metrics.areal_train.diagnose import diagnose, table

    torch.set_num_threads(cfg.threads)
    spec = warmstart.spec_for(cfg)
    from areal_metrics.areal_train.settings import TrainerSettings

    policy = warmstart.load(spec, cache=TrainerSettings.from_env().warmstart_dir())
    rows = diagnose(policy, size=args.diagnose_size, k=args.diagnose_k, attempt_len=cfg.max_response_len)
    print(f"warm start {spec.key()} ({policy.n_parameters():,} parameters; {spec}); held-out evaluation prompts, "
          f"greedy once and {args.diagnose_k} samples at temperature 1 each")
    print(table(rows, args.diagnose_k))
    return 0


def _check_resumable(cfg: object, args: argparse.Namespace) -> None:
    """A one-line error before any rank starts: no checkpoint, other rank count, nothing left to train."""
    from areal_metrics.areal_train.checkpoint import latest_meta
    from areal_metrics.areal_train.session import checkpoint_root
    from areal_metrics.producers.contract.settings import state_dir

    root = checkpoint_root(cfg, state_dir())  # type: ignore[arg-type]
    meta = latest_meta(root, args.run_id)
    if meta is None:
        raise UserError(f"--resume: no checkpoint of run {args.run_id} in {root}")
    if meta.get("world_size") != args.nproc:
        raise UserError(f"--nproc: the checkpoint of {args.run_id} was written by {meta.get('world_size')} ranks "
                        f"(got {args.nproc})")
    if args.steps <= int(meta["step"]):
        raise UserError(f"--steps: {args.steps} is not beyond the checkpoint's step {meta['step']}")


def _reachable(bootstrap: str, timeout: float = 1.0) -> bool:
    """Whether any bootstrap address accepts a TCP connection."""
    import socket

    for address in bootstrap.split(","):
        host, _, port = address.strip().rpartition(":")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
                return True
        except (OSError, ValueError):
            continue
    return False
