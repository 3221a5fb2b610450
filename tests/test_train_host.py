"""The host that forks a run's ranks (`areal_metrics.areal_train.host`), without a broker: failures, signals, logs."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.launch import start

ENDLESS = 1_000_000  # steps: these runs end only when the test ends them
TINY = TrainConfig(publish=False, d_model=32, layers=2, heads=2, warmstart_steps=0, batch_prompts=2, eval_size=8, quick_size=4,
                   max_response_len=8, checkpoint_every_steps=None, eval_at_start=False, eval_at_end=False,
                   eval_every_steps=None)


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def until(condition, timeout: float = 180.0) -> bool:
    """`condition()` within `timeout`: ranks can take minutes to reach step 1 on a loaded machine (tests/test_faults.py)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def training(log: Path) -> bool:
    return log.exists() and "step 1 reward" in log.read_text(errors="replace")


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")


def test_the_ranks_are_children_of_one_host_each_with_its_own_log_and_a_stop_reaches_them_all(tmp_path) -> None:
    run = start("host-stop", 2, ENDLESS, TINY, log_dir=tmp_path)
    try:
        ranks = run.rank_pids()
        host = run.procs[0].pid
        assert sorted(ranks) == [0, 1] and len(run.procs) == 1
        assert all(parent_of(pid) == host for pid in ranks.values())
        assert until(lambda: training(tmp_path / "host-stop-r0.log"))
    finally:
        run.terminate(grace=30)
    assert run.procs[0].returncode not in (None, 0)  # stopped, not finished
    assert not any(alive(pid) for pid in ranks.values())
    logs = [(tmp_path / f"host-stop-r{rank}.log").read_text(errors="replace") for rank in (0, 1)]
    assert " r0 " in logs[0] and " r0 " not in logs[1]  # each rank writes its own log ...
    assert logs[1].count("KeyboardInterrupt: signal 15") == 1 and logs[0].count("KeyboardInterrupt: signal 15") == 1
    # ... and each was stopped by the SIGTERM the host passed on (the worker's `killed` path)


def test_a_rank_killed_ends_the_run_with_its_signal_and_the_host_stops_the_other(tmp_path) -> None:
    run = start("host-kill", 2, ENDLESS, TINY, log_dir=tmp_path)
    try:
        ranks = run.rank_pids()
        assert until(lambda: training(tmp_path / "host-kill-r0.log"))
        os.kill(ranks[1], signal.SIGKILL)
        assert run.wait(timeout=60) == 128 + signal.SIGKILL
        assert not alive(ranks[0])  # rank 0 was stopped, not left waiting in a collective for a dead peer
    finally:
        run.terminate()


def test_the_ranks_die_with_their_host(tmp_path) -> None:
    run = start("host-dies", 2, ENDLESS, TINY, log_dir=tmp_path)
    try:
        ranks = run.rank_pids()
        os.kill(run.procs[0].pid, signal.SIGKILL)
        assert until(lambda: not any(alive(pid) for pid in ranks.values()), timeout=30)
    finally:
        run.terminate()


def test_the_launcher_finds_a_cached_warm_start_without_importing_torch(tmp_path) -> None:
    """`areal-metrics demo` and `train` start (and exit) without torch in their own process."""
    import subprocess
    import sys

    check = """
import sys
from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.launch import prepare
from areal_metrics.areal_train.settings import TrainerSettings
from areal_metrics.areal_train.warmstart_cache import path_for, spec_for
cfg = TrainConfig()
cache = TrainerSettings.from_env().warmstart_dir()
path = path_for(spec_for(cfg), cache)
path.parent.mkdir(parents=True, exist_ok=True)
path.write_bytes(b"cached")
prepare(cfg, cache)
assert "torch" not in sys.modules, "prepare imported torch"
print("no torch")
"""
    env = {**os.environ, "AREAL_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "no torch" in done.stdout, done.stderr[-2000:]
