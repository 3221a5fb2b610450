"""The local stack: Kafka broker, stream worker and sink as background processes.

All state lives under one folder (`AREAL_HOME`, default `.areal/`):
`kafka/` (broker data and log), `logs/` (worker and sink logs), the store
(`clickhouse/` for the embedded engine) and `stack.json`, which records the
pids and the broker address so that `down`, `status` and every client find
them. The broker keeps its port across restarts, so a client configured once
keeps working.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from producers.settings import state_dir

from areal_metrics.stack.kafka_broker import KafkaBroker, create_topics, kafka_version, pid_alive, port_open, stop_pid

SERVICES = ("worker", "sink")  # started after the broker, stopped before it
SERVICE_MODULES = {"worker": "streams", "sink": "sinks"}


@dataclass
class StackInfo:
    kafka_bootstrap: str
    kafka_port: int
    controller_port: int
    kafka_version: str
    topic_prefix: str
    clickhouse_url: str
    home: str
    pids: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0

    def alive(self) -> dict[str, bool]:
        return {name: pid_alive(pid) for name, pid in self.pids.items()}

    def running(self) -> bool:
        alive = self.alive()
        return bool(alive) and all(alive.values()) and port_open("127.0.0.1", self.kafka_port)


def info_path() -> Path:
    return state_dir() / "stack.json"


def read_info() -> StackInfo | None:
    try:
        return StackInfo(**json.loads(info_path().read_text()))
    except (OSError, ValueError, TypeError):
        return None


def write_info(info: StackInfo) -> None:
    path = info_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(info), indent=2))
    os.replace(tmp, path)


def _start_service(name: str, env: dict[str, str], logs: Path) -> int:
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", SERVICE_MODULES[name]],
            env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives `areal-metrics up`
        )
    return proc.pid


def service_env(info: StackInfo) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        AREAL_KAFKA_BOOTSTRAP=info.kafka_bootstrap,
        AREAL_TOPIC_PREFIX=info.topic_prefix,
        AREAL_CLICKHOUSE_URL=info.clickhouse_url,
        AREAL_HOME=info.home,
        PYTHONUNBUFFERED="1",
    )
    return env


def up(partitions: int = 3, services: tuple[str, ...] = SERVICES, timeout: float = 120.0) -> tuple[StackInfo, bool]:
    """Start what is not running; returns (info, started_anything)."""
    from producers.settings import Settings
    from producers.topics import Topics

    home = state_dir()
    previous = read_info()
    if previous is not None and previous.running() and set(previous.pids) >= {"kafka", *services}:
        os.environ.setdefault("AREAL_KAFKA_BOOTSTRAP", previous.kafka_bootstrap)
        return previous, False
    if previous is not None:  # stale or partial: stop what is left, keep data and ports
        down(previous)
    settings = Settings.from_env()
    broker = KafkaBroker(
        home / "kafka",
        port=_reuse_port(previous.kafka_port if previous else 0),
        controller_port=_reuse_port(previous.controller_port if previous else 0),
        partitions=partitions,
    )
    broker.start(timeout=timeout, detach=True)
    assert broker.process is not None
    info = StackInfo(
        kafka_bootstrap=broker.bootstrap,
        kafka_port=broker.port,
        controller_port=broker.controller_port,
        kafka_version=kafka_version(),
        topic_prefix=settings.topic_prefix,
        clickhouse_url=os.environ.get("AREAL_CLICKHOUSE_URL") or f"chdb://{home / 'clickhouse'}",
        home=str(home),
        pids={"kafka": broker.process.pid},
        started_at=time.time(),
    )
    write_info(info)  # now `down` can stop the broker even if what follows fails
    os.environ.setdefault("AREAL_KAFKA_BOOTSTRAP", info.kafka_bootstrap)  # for this process's later verbs
    create_topics(info.kafka_bootstrap, Topics(info.topic_prefix).all(), partitions)
    env = service_env(info)
    for name in services:
        info.pids[name] = _start_service(name, env, home / "logs")
        write_info(info)
    time.sleep(1.0)
    dead = [name for name, ok in info.alive().items() if not ok]
    if dead:
        raise RuntimeError(f"{', '.join(dead)} exited at start; see {home / 'logs'}")
    return info, True


def _reuse_port(port: int) -> int:
    return port if port and not port_open("127.0.0.1", port) else 0


def down(info: StackInfo | None = None) -> list[str]:
    """Stop every process the stack started (services first); returns what was stopped."""
    info = info or read_info()
    if info is None:
        return []
    stopped = []
    for name in (*SERVICES, "kafka"):
        pid = info.pids.get(name)
        if pid and pid_alive(pid):
            stop_pid(pid, timeout=30)
            stopped.append(name)
    info.pids = {}
    write_info(info)
    return stopped
