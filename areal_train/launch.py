"""Start a training run as N local processes (one per rank) and wait for it.

`launch(...)` blocks until the run ends and returns its exit status;
`start(...)` returns a `Run` handle at once, so a caller can run several side
by side (the demo) and `wait()` on each. If one rank fails, the others are
stopped, so a run never hangs on a dead peer.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from areal_train.config import TrainConfig, load


@dataclass
class Run:
    run_id: str
    procs: list[subprocess.Popen[bytes]]
    logs: list[IO[bytes]] = field(default_factory=list)

    def poll(self) -> int | None:
        """None while any rank runs; else the run's exit status (the first nonzero, or 0)."""
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes):
            self.terminate()
            return next(c for c in codes if c not in (None, 0))
        return None if any(c is None for c in codes) else 0

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(run_id: str, nproc: int, steps: int, config: TrainConfig | str | Path | None = None, *,
          env: dict[str, str] | None = None, log_dir: str | Path | None = None,
          summary_dir: str | Path | None = None, resume: bool = False) -> Run:
    """Spawn the ranks of one run and return at once.

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
    prepare(cfg)
    base_env = dict(os.environ if env is None else env)
    base_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc),
                    OMP_NUM_THREADS=str(cfg.threads), PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "areal_train.worker", "--run-id", run_id, "--steps", str(steps),
            "--config-json", json.dumps(cfg.to_dict())]
    if summary_dir is not None:
        argv += ["--summary-dir", str(summary_dir)]
    if resume:
        argv.append("--resume")
    run = Run(run_id, [])
    for rank in range(nproc):
        out: IO[bytes] | None = None
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            out = open(Path(log_dir) / f"{run_id}-r{rank}.log", "wb")
            run.logs.append(out)
        run.procs.append(subprocess.Popen(argv, env={**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=out, stderr=subprocess.STDOUT if out else None))
    return run


def prepare(cfg: TrainConfig) -> None:
    """Build the cached warm start this config needs, if it is missing."""
    if cfg.warmstart_steps > 0:
        from areal_train.warmstart import ensure, spec_for

        ensure(spec_for(cfg))


def launch(run_id: str, nproc: int, steps: int, config: TrainConfig | str | Path | None = None, *,
           timeout: float | None = None, **kw: object) -> int:
    """Run to the end; the exit status of the run (0 when every rank succeeded)."""
    run = start(run_id, nproc, steps, config, **kw)  # type: ignore[arg-type]
    try:
        return run.wait(timeout)
    except KeyboardInterrupt:
        run.terminate()
        raise
