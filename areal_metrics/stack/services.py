"""The local stack: Kafka broker(s), stream worker and sink as background processes.

All state lives under one folder (`AREAL_HOME`, default `~/.areal/`, one per user):
`kafka/` (broker data and log; `kafka-cluster/node-N/` for `--brokers 3`), `logs/`
(worker and sink logs), the store (`clickhouse/` for the embedded engine) and
`stack.json`, which records the pids and the broker addresses so that `down`,
`status` and every client find them. The brokers keep their ports across
restarts, so a client configured once keeps working.

With `brokers > 1` the stack is a KRaft cluster (`kafka_cluster.py`); its topics,
and those the services create, get replication factor = brokers and
`min.insync.replicas` = 2 unless AREAL_KAFKA_REPLICATION_FACTOR /
AREAL_KAFKA_MIN_INSYNC_REPLICAS say otherwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import msgspec

from areal_metrics.producers.contract.settings import Settings, state_dir

from areal_metrics.errors import UserError
from areal_metrics.extras import importable
from areal_metrics.stack.kafka_broker import KafkaBroker, create_topics, kafka_version, pid_alive, port_open, stop_pid
from areal_metrics.stack.kafka_cluster import KafkaCluster
from areal_metrics.stack.settings import StackSettings
from areal_metrics.stack.supervisor import MODULES, read_record
from areal_metrics.producers.contract.settings import is_set, read_setting

SERVICES = ("worker", "sink")  # started after the broker, stopped before it
SERVICE_MODULES = MODULES  # each run by its supervisor (stack/supervisor.py)
# What each service imports from the `stack` extra (chdb only for the embedded store)
SERVICE_NEEDS = {"worker": ("faust",), "sink": ("clickhouse_connect", "chdb")}
INSTALL_HINT = "pip install 'areal-metrics[stack]'"


def missing_modules(services: tuple[str, ...], clickhouse_url: str) -> list[str]:
    """The modules of the `stack` extra that the services would fail to import, in order."""
    out: list[str] = []
    for name in services:
        for module in SERVICE_NEEDS[name]:
            if module == "chdb" and not clickhouse_url.startswith("chdb:"):
                continue
            if module not in out and not importable(module):
                out.append(module)
    return out


def restarts(home: str | Path, name: str) -> int:
    """How often the service's supervisor restarted it since `up` (0 when unknown)."""
    n = read_record(home, name).get("restarts")
    return n if isinstance(n, int) else 0


def failure_reason(home: str | Path, name: str) -> str:
    """Why a service that is not running stopped: the last line of its log ("" when none)."""
    try:
        with open(Path(home) / "logs" / f"{name}.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = [line.strip() for line in f.read().decode("utf-8", "replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:500] if lines else ""


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
    # a cluster: [client port, controller port] of every node (node N's pid is "kafka-N")
    brokers: int = 1
    kafka_ports: list[list[int]] = field(default_factory=list)
    replication_factor: int = 1
    min_insync_replicas: int = 1

    def alive(self) -> dict[str, bool]:
        return {name: pid_alive(pid) for name, pid in self.pids.items()}

    def broker_ports(self) -> list[int]:
        return [p for p, _ in self.kafka_ports] or [self.kafka_port]

    def running(self) -> bool:
        alive = self.alive()
        return bool(alive) and all(alive.values()) and all(port_open("127.0.0.1", p) for p in self.broker_ports())


def info_path() -> Path:
    return state_dir() / "stack.json"


def read_info() -> StackInfo | None:
    """What `up` recorded; None when there is none, or it is not what `up` writes (every field of its
    type: a pid that is text, a port that is a list are as unreadable as torn JSON)."""
    try:
        return msgspec.convert(json.loads(info_path().read_text()), StackInfo)
    except (OSError, ValueError, RecursionError, msgspec.ValidationError):
        return None


def write_info(info: StackInfo) -> None:
    path = info_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(info), indent=2))
    os.replace(tmp, path)


def _start_service(name: str, env: dict[str, str], logs: Path) -> int:
    """The service under its supervisor (areal_metrics/stack/supervisor.py: restarts with back-off);
    the pid returned, recorded as the service's, is the supervisor's."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "areal_metrics.stack.supervisor", name],
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
        AREAL_KAFKA_REPLICATION_FACTOR=str(info.replication_factor),
        AREAL_KAFKA_MIN_INSYNC_REPLICAS=str(info.min_insync_replicas),
        PYTHONUNBUFFERED="1",
    )
    return env


def broker_names(brokers: int) -> list[str]:
    """The pid names of the stack's brokers: "kafka" alone, "kafka-1".."kafka-N" in a cluster."""
    return ["kafka"] if brokers == 1 else [f"kafka-{i}" for i in range(1, brokers + 1)]


def broker_dir(home: Path, brokers: int) -> Path:
    return home / ("kafka" if brokers == 1 else "kafka-cluster")


def cluster_settings(settings: Settings, brokers: int) -> Settings:
    """A cluster's durability unless the environment chose: every broker a replica, 2 in sync."""
    if brokers == 1:
        return settings
    return replace(
        settings,
        kafka_replication_factor=settings.kafka_replication_factor
        if is_set("kafka_replication_factor") else brokers,
        kafka_min_insync_replicas=settings.kafka_min_insync_replicas
        if is_set("kafka_min_insync_replicas") else min(2, brokers),
    )


def up(partitions: int = 3, services: tuple[str, ...] = SERVICES, timeout: float = 120.0,
       brokers: int | None = None) -> tuple[StackInfo, bool]:
    """Start what is not running; returns (info, started_anything).

    `brokers`: 1 (one broker), 3 (a KRaft cluster), None: as the stack here was made (1 if new).
    A stack made with another broker count is refused (its Kafka log is elsewhere), with one line.
    """
    home = state_dir()
    previous = read_info()
    if brokers is None:
        brokers = previous.brokers if previous is not None else 1
    if previous is not None and previous.brokers != brokers and broker_dir(home, previous.brokers).exists():
        raise UserError(
            f"the stack in {home} was made with {previous.brokers} broker(s), whose Kafka log is the source of "
            f"truth; use --brokers {previous.brokers}, or `areal-metrics down` and remove {home} for a new stack")
    if previous is not None and previous.running() and set(previous.pids) >= {*broker_names(brokers), *services}:
        os.environ.setdefault("AREAL_KAFKA_BOOTSTRAP", previous.kafka_bootstrap)
        return previous, False
    clickhouse_url = read_setting("clickhouse_url") or f"chdb://{home / 'clickhouse'}"
    missing = missing_modules(services, clickhouse_url)
    if missing:  # before anything starts: nothing is left behind
        raise UserError(f"the stack's services need the `stack` extra (missing: {', '.join(missing)}): {INSTALL_HINT}")
    if previous is not None:  # stale or partial: stop what is left, keep data and ports
        down(previous)
    settings = cluster_settings(Settings.from_env(), brokers)
    specs = settings.topics.specs(settings)  # a setting Kafka would refuse fails here, before any start
    stack = StackSettings.from_env()  # the brokers' JVM heap and jars
    info = _start_brokers(home, brokers, partitions, previous, timeout, settings, stack)
    write_info(info)  # now `down` can stop the brokers even if what follows fails
    try:
        os.environ.setdefault("AREAL_KAFKA_BOOTSTRAP", info.kafka_bootstrap)  # for this process's later verbs
        create_topics(info.kafka_bootstrap, specs, partitions)
        env = service_env(info)
        for name in services:
            info.pids[name] = _start_service(name, env, home / "logs")
            write_info(info)
        time.sleep(1.0)
        dead = [name for name, ok in info.alive().items() if not ok]
        if dead:
            reasons = "; ".join(f"{name}: {failure_reason(home, name) or 'no output'}" for name in dead)
            raise RuntimeError(f"{', '.join(dead)} exited at start ({reasons}); stopped the rest; "
                               f"logs in {home / 'logs'}")
    except BaseException:  # a half-started stack is stopped, not left running
        down(info)
        raise
    return info, True


def _start_brokers(home: Path, brokers: int, partitions: int, previous: StackInfo | None,
                   timeout: float, settings: Settings, stack: StackSettings) -> StackInfo:
    """Start one broker or a cluster on the ports of the previous start where free; its StackInfo."""
    common = dict(kafka_version=kafka_version(), topic_prefix=settings.topic_prefix, home=str(home),
                  started_at=time.time(), replication_factor=settings.kafka_replication_factor,
                  min_insync_replicas=settings.kafka_min_insync_replicas,
                  clickhouse_url=read_setting("clickhouse_url") or f"chdb://{home / 'clickhouse'}")
    if brokers == 1:
        broker = KafkaBroker(
            broker_dir(home, 1),
            port=_reuse_port(previous.kafka_port if previous else 0),
            controller_port=_reuse_port(previous.controller_port if previous else 0),
            partitions=partitions,
            stack=stack,
        )
        broker.start(timeout=timeout, detach=True)
        assert broker.process is not None
        return StackInfo(kafka_bootstrap=broker.bootstrap, kafka_port=broker.port,
                         controller_port=broker.controller_port, pids={"kafka": broker.process.pid}, **common)
    old = previous.kafka_ports if previous else []
    cluster = KafkaCluster(broker_dir(home, brokers), size=brokers, partitions=partitions,
                           ports=[(_reuse_port(p), _reuse_port(c)) for p, c in old], stack=stack)
    cluster.start(timeout=timeout, detach=True)
    first = cluster.nodes[0]
    return StackInfo(kafka_bootstrap=cluster.bootstrap, kafka_port=first.port, controller_port=first.controller_port,
                     pids={name: n.process.pid for name, n in zip(broker_names(brokers), cluster.nodes)
                           if n.process is not None},
                     brokers=brokers, kafka_ports=[[p, c] for p, c in cluster.ports], **common)


def _reuse_port(port: int, wait_s: float = 5.0) -> int:
    """`port` when nothing listens on it (waiting up to `wait_s` for a process just stopped to let go), else 0."""
    if not port:
        return 0
    deadline = time.monotonic() + wait_s
    while port_open("127.0.0.1", port):
        if time.monotonic() > deadline:
            return 0
        time.sleep(0.1)
    return port


def down(info: StackInfo | None = None) -> list[str]:
    """Stop every process the stack started (services first); returns what was stopped."""
    info = info or read_info()
    if info is None:
        return []
    stopped = []
    for name in SERVICES:
        pid = info.pids.get(name)
        if pid and pid_alive(pid):
            stop_pid(pid, timeout=30)  # the supervisor passes the signal on to the service
            stopped.append(name)
        child = read_record(info.home, name).get("pid")
        if isinstance(child, int) and child != pid and pid_alive(child):  # a supervisor killed before its service
            stop_pid(child, timeout=10)
    # every broker at once: stopped one by one, the last would wait for a quorum that is gone
    brokers = {name: pid for name, pid in info.pids.items() if name.startswith("kafka") and pid_alive(pid)}
    for pid in brokers.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for name, pid in brokers.items():
        stop_pid(pid, timeout=30)
        stopped.append(name)
    info.pids = {}
    write_info(info)
    return stopped
