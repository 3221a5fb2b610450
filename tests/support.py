"""Helpers the test modules share: the CLI as a process, waiting for a condition, the
project's services as processes, a child's environment. One copy of each."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "areal_metrics"]


def cli(*args: str, env: dict[str, str] | None = None, input: str | None = None,
        timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """`areal-metrics ARGS` as a user runs it: its exit status, stdout and stderr as text."""
    return subprocess.run([*CLI, *args], env=env, input=input, capture_output=True, text=True, timeout=timeout)


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.5) -> Any:
    """check()'s first truthy value, polled every `every` seconds; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def child_env(stack_env: dict[str, str], **extra: str) -> dict[str, str]:
    """The stack's environment for a child trainer process, without a launcher's rank variables."""
    env = {k: v for k, v in stack_env.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_"))}
    env.update(PYTHONPATH=str(ROOT), AREAL_EXIT_TIMEOUT_S="20", **extra)
    return env


def start_service(module: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """`python -m MODULE` (e.g. areal_metrics.streams) as a process, its output in `log`."""
    return subprocess.Popen([sys.executable, "-m", module], env=env, cwd=ROOT, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after 30 s; waits for the process either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def logger_warnings(logger: logging.Logger) -> Iterator[list[logging.LogRecord]]:
    """The warnings of `logger` while in the block, from a handler on that logger object itself: pass
    the module's own (`migrations.log`), not `logging.getLogger(name)`. In a full session neither
    the root (caplog) nor a logger looked up by name again always saw them: an earlier test's
    library left the root's handlers, or the loggers' registry, other than at import."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    log = logger
    level, disabled = log.level, log.disabled
    log.addHandler(handler)
    log.setLevel(logging.WARNING)
    log.disabled = False
    try:
        yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.disabled = disabled


def replay_changelog(sent: Iterable[tuple[Any, bytes, bytes | None]]) -> dict[bytes, bytes]:
    """What a worker recovering from the changelog reads: (partition, key, value) records in order,
    a None value a tombstone that deletes its key."""
    replayed: dict[bytes, bytes] = {}
    for _, key, value in sent:
        if value is None:
            replayed.pop(key, None)
        else:
            replayed[key] = value
    return replayed


def group_members_when(bootstrap: str, group: str, want: int, timeout: float) -> int:
    """The consumer group's member count, once it is `want` (or at the timeout). A fresh broker has
    no group coordinator for a moment: that reads as no member yet."""
    from kafka import KafkaAdminClient
    from kafka.errors import CoordinatorNotAvailableError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        deadline, count = time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            try:
                info = admin.describe_groups([group])[group]
            except CoordinatorNotAvailableError:
                info = {}
            count = len(info.get("members", [])) if info.get("group_state") == "Stable" else 0
            if count == want:
                break
            time.sleep(0.5)
        return count
    finally:
        admin.close()


def service_env(bootstrap: str, prefix: str, tmp_path: Path, **extra: str) -> dict[str, str]:
    """Environment for subprocesses (worker, sink, trainer) wired to the broker at `bootstrap`, their
    state and store under `tmp_path` (conftest's `stack_env` for the session broker; a test's own
    broker, or none, otherwise)."""
    import os

    return {**os.environ, "AREAL_KAFKA_BOOTSTRAP": bootstrap, "AREAL_TOPIC_PREFIX": prefix,
            "AREAL_HOME": str(tmp_path / "areal"), "AREAL_CLICKHOUSE_URL": f"chdb://{tmp_path / 'clickhouse'}",
            "PYTHONUNBUFFERED": "1", **extra}


@contextmanager
def silent_server() -> Iterator[int]:
    """The port of a loopback server that accepts every connection and never answers: a broker still
    starting, a port-forward to a pod that is down, a ClickHouse or Grafana that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(50)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for s in held + [server]:
            s.close()
