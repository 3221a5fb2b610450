"""Start a training run as N local processes (one per rank) and wait for it.

`launch(...)` blocks until the run ends and returns its exit status;
`start(...)` returns a `Run` handle at once, so a caller can run several side
by side (the demo) and `wait()` on each. The ranks are forked by one host
process (`areal_metrics.areal_train.host`), so the trainer is imported once per run, not
once per rank. If one rank fails, the others are stopped, so a run never
hangs on a dead peer.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from areal_metrics.areal_train.config import TrainConfig, load
from areal_metrics.areal_train.settings import TrainerSettings


@dataclass
class Run:
    run_id: str
    procs: list[subprocess.Popen[bytes]]  # the host process of the ranks
    logs: list[IO[bytes]] = field(default_factory=list)
    pid_file: Path | None = None  # where the host writes {rank: pid}

    def poll(self) -> int | None:
        """None while any rank runs; else the run's exit status (the first failing rank's, or 0)."""
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes):
            self.terminate()
            return next(c for c in codes if c not in (None, 0))
        return None if any(c is None for c in codes) else 0

    def rank_pids(self, timeout: float = 60.0) -> dict[int, int]:
        """rank -> process id, once the host has started every rank."""
        deadline = time.monotonic() + timeout
        while self.pid_file is None or not self.pid_file.exists():
            if self.pid_file is None or time.monotonic() > deadline or self.poll() is not None:
                raise RuntimeError(f"run {self.run_id}: its ranks did not start")
            time.sleep(0.05)
        return {int(rank): pid for rank, pid in json.loads(self.pid_file.read_text()).items()}

    def wait(self, timeout: float | None = None) -> int:
        """Wait for every rank; on timeout stop them all and raise TimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                self.terminate()
                raise TimeoutError(f"run {self.run_id} did not finish within {timeout:.0f} s")
            time.sleep(0.1)
        for p in self.procs:
            p.wait()
        self._close_logs()
        return code

    def terminate(self, grace: float = 5.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._close_logs()

    def _close_logs(self) -> None:
        for f in self.logs:
            f.close()
        self.logs = []
        if self.pid_file is not None:
            shutil.rmtree(self.pid_file.parent, ignore_errors=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(run_id: str, nproc: int, steps: int, config: TrainConfig | str | Path | None = None, *,
          env: dict[str, str] | None = None, log_dir: str | Path | None = None,
          summary_dir: str | Path | None = None, resume: bool = False) -> Run:
    """Start the ranks of one run and return at once.

    The ranks are forked by one host process (`areal_metrics.areal_train.host`), which imports
    the trainer once for all of them, stops the others when one fails and
    passes a SIGTERM on to every rank.
    `config`: a TrainConfig, a JSON/TOML file, or None for the defaults.
    `env`: the environment of the ranks (default: this process's), which
    carries AREAL_KAFKA_BOOTSTRAP / AREAL_TOPIC_PREFIX / AREAL_HOME.
    `log_dir`: write each rank's output to `<log_dir>/<run_id>-r<rank>.log`
    instead of this terminal (a live view needs the terminal to itself).
    `resume`: continue from the run's last checkpoint (a new attempt).
    The warm start is built here first if it is not cached, so the ranks
    (and runs started side by side) never wait for it on a timeout.
    """
    if nproc < 1 or steps < 1:
        raise ValueError("nproc and steps must be >= 1")
    cfg = config if isinstance(config, TrainConfig) else load(config)
    run_env = dict(os.environ if env is None else env)
    # where the ranks will look for the warm start: their environment's AREAL_CACHE_DIR
    prepare(cfg, TrainerSettings.from_env(run_env).warmstart_dir())
    run_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                   OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1")
    worker = ["--run-id", run_id, "--steps", str(steps), "--config-json", json.dumps(cfg.to_dict())]
    if summary_dir is not None:
        worker += ["--summary-dir", str(summary_dir)]
    if resume:
        worker.append("--resume")
    pid_file = Path(tempfile.mkdtemp(prefix="areal-run-")) / "ranks.json"
    host = [sys.executable, "-m", "areal_metrics.areal_train.host", "--ranks", str(nproc), "--pid-file", str(pid_file)]
    run = Run(run_id, [], pid_file=pid_file)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        run.logs = [open(Path(log_dir) / f"{run_id}-r{rank}.log", "wb") for rank in range(nproc)]
        host += ["--log-fds", ",".join(str(f.fileno()) for f in run.logs)]
    out = run.logs[0] if run.logs else None  # the host's own messages go to rank 0's log
    run.procs.append(subprocess.Popen([*host, "--", *worker], env=run_env, stdout=out,
                                      stderr=subprocess.STDOUT if out else None,
                                      pass_fds=[f.fileno() for f in run.logs]))
    return run


def prepare(cfg: TrainConfig, cache: Path) -> None:
    """Build the cached warm start this config needs in the folder `cache`
    (TrainerSettings.warmstart_dir()), if it is missing."""
    if cfg.warmstart_steps > 0:
        from areal_metrics.areal_train.warmstart_cache import path_for, spec_for

        if path_for(spec_for(cfg), cache).exists():  # found without importing torch into the launcher
            return
        from areal_metrics.areal_train.warmstart import ensure

        ensure(spec_for(cfg), cache=cache)


def launch(run_id: str, nproc: int, steps: int, config: TrainConfig | str | Path | None = None, *,
           timeout: float | None = None, **kw: object) -> int:
    """Run to the end; the exit status of the run (0 when every rank succeeded)."""
    run = start(run_id, nproc, steps, config, **kw)  # type: ignore[arg-type]
    try:
        return run.wait(timeout)
    except KeyboardInterrupt:
        run.terminate()
        raise
