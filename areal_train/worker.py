"""One rank of a training run: `python -m areal_metrics.areal_train.worker` (started by `areal_metrics.areal_train.launch`).

The launcher passes the rank layout in the usual torch.distributed variables
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and the run in arguments. This
shell forks the rank's evaluation process (async evaluation), starts
torch.distributed and the trainer, and writes a
summary JSON when asked to. The run is reported through the public client only
(`areal_metrics.areal_train.reporting.open_client_run`: `init` with the checkpoint's attempt).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from areal_metrics.areal_train.config import from_mapping
from areal_metrics.areal_train.eval_process import fork_standby
from areal_metrics.areal_train.reporting import open_client_run
from areal_metrics.areal_train.settings import TrainerSettings
from areal_metrics.areal_train.trainer import train
from areal_metrics.producers.contract.settings import state_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_metrics.areal_train.worker")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--config-json", default="{}", help="the full TrainConfig as JSON")
    parser.add_argument("--summary-dir", default=None)
    parser.add_argument("--resume", action="store_true", help="continue from the run's last checkpoint")
    args = parser.parse_args(argv)

    # The publisher's sender thread and kafka-python's I/O thread share the GIL with
    # this loop; a shorter switch interval hands it back to training sooner
    # (`python -m benchmarks.bench_train --publishing` measures the overhead).
    sys.setswitchinterval(0.001)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s r{rank} %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    cfg = from_mapping(json.loads(args.config_json))

    # Forked now, before gloo and the client start their threads: the evaluation process
    # inherits this interpreter's torch instead of importing it again.
    standby = fork_standby() if cfg.eval_mode == "async" else None
    if world_size > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=5))
    signal.signal(signal.SIGTERM, _interrupt)  # the launcher stops a run with SIGTERM: the run ends `killed`
    # this process's entry: the warm starts' folder (AREAL_CACHE_DIR) and the state folder (AREAL_HOME)
    summary = train(cfg, args.run_id, args.steps, rank, world_size,
                    open_run=open_client_run if cfg.publish else None, resume=args.resume, eval_standby=standby,
                    warmstarts=TrainerSettings.from_env().warmstart_dir(), home=state_dir())
    if args.summary_dir:
        path = Path(args.summary_dir) / f"rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(summary)))
    logging.getLogger("areal_train").info(
        "%s rank %d done: %d steps, reward %.3f -> %.3f, %.1f s on %s", args.run_id, rank, summary.steps,
        summary.first_reward, summary.last_reward, summary.seconds, summary.device)
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())
