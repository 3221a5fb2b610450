"""The real Apache Kafka broker (KRaft) from the Maven Central jars.

The broker version lives in one place: `kafka/pom.xml` (`kafka.version`).
`ensure_jars()` lets Maven fetch `org.apache.kafka:kafka_2.13` and its runtime
dependencies once into a cache folder; `KafkaBroker` formats the storage with
`kafka.tools.StorageTool` and runs `kafka.Kafka` on loopback ports: on its own
(one broker+controller node), or as one node of a `KafkaCluster`
(`kafka_cluster.py`), which sets `node_id`, `voters`, `cluster_id` and `replicas`.

Secured (`scram_users` and `super_user`): the only client listener is SASL_PLAINTEXT with
SCRAM-SHA-256/512, users made when the storage is formatted (KIP-900), the standard KRaft
authorizer with `allow.everyone.if.no.acl.found=false`, and `super_user` for the broker's own
traffic and for admin work (topics, ACLs; `admin_config()`). docs/SECURITY.md.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from areal_metrics.errors import UserError
from areal_metrics.producers.contract.topics import TopicSpec
from areal_metrics.producers.runtime.kafka_wait import bootstrap_reachable
from areal_metrics.stack.settings import StackSettings

POM = Path(__file__).with_name("kafka") / "pom.xml"


def kafka_version() -> str:
    match = re.search(r"<kafka\.version>([^<]+)</kafka\.version>", POM.read_text())
    assert match, f"no kafka.version in {POM}"
    return match.group(1)


def ensure_jars(stack: StackSettings) -> Path:
    """The folder of broker jars (`stack`: AREAL_KAFKA_JARS, XDG_CACHE_HOME), fetched by Maven on
    first use (idempotent)."""
    target = stack.kafka_jars_dir(kafka_version())
    if any(target.glob("kafka_2.13-*.jar")):
        return target
    if shutil.which("java") is None:
        raise UserError("Java 17+ is needed for the local Kafka broker: `java` is not on PATH")
    if shutil.which("mvn") is None:
        raise UserError("Maven is needed to fetch the Kafka jars: `mvn` is not on PATH")
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    result = subprocess.run(
        ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
         f"-DoutputDirectory={partial}", "-DincludeScope=runtime"],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-3:]
        raise UserError(f"Maven could not fetch the Kafka {kafka_version()} jars: {' | '.join(tail)}")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        partial.rename(target)  # atomic: a concurrent fetch may have won, which is fine
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    return bootstrap_reachable([f"{host}:{port}"], timeout)  # the one TCP check (producers/runtime/kafka_wait.py)


@dataclass
class KafkaBroker:
    """One KRaft broker+controller whose state lives under `data_dir`."""

    data_dir: Path
    port: int = 0
    controller_port: int = 0
    partitions: int = 3
    # One node of a cluster: its id, the controller quorum ("1@host:port,2@..."; default:
    # this node alone), the id every node is formatted with, and how many copies the
    # broker's own topics (consumer offsets, transactions) and auto-created topics get.
    node_id: int = 1
    voters: str = ""
    cluster_id: str = ""
    replicas: int = 1
    # Optional SASL/PLAIN listener beside the plain one (user -> password), to test secured clients.
    sasl_users: dict[str, str] = field(default_factory=dict, repr=False)
    sasl_port: int = 0
    # Secured: SCRAM users (name -> password) and the super user among them; see the module doc.
    scram_users: dict[str, str] = field(default_factory=dict, repr=False)
    super_user: str = ""
    # the JVM's heap and the jars' folder (AREAL_KAFKA_HEAP, AREAL_KAFKA_JARS): the caller reads them
    # (`StackSettings.from_env()`); the defaults otherwise
    stack: StackSettings = field(default_factory=StackSettings, repr=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).absolute()
        self.port = self.port or free_port()
        self.controller_port = self.controller_port or free_port()
        if self.sasl_users:
            self.sasl_port = self.sasl_port or free_port()
        if self.super_user and self.super_user not in self.scram_users:
            raise ValueError(f"super_user {self.super_user!r} is not among scram_users")

    @property
    def secured(self) -> bool:
        return bool(self.super_user)

    def admin_config(self) -> dict[str, object]:
        """kafka-python settings of the super user (secured), or none (the plain listener)."""
        if not self.secured:
            return {}
        return {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-256",
                "sasl_plain_username": self.super_user, "sasl_plain_password": self.scram_users[self.super_user]}

    @property
    def sasl_bootstrap(self) -> str:
        return f"127.0.0.1:{self.sasl_port}"

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "broker.log"

    def _write_config(self) -> Path:
        logs = self.data_dir / "logs"
        min_isr = str(min(2, self.replicas))  # a cluster of 3 takes a write with one node down
        props = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": self.voters or f"{self.node_id}@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
            "log.dirs": str(logs),
            "num.partitions": str(self.partitions),
            "auto.create.topics.enable": "true",
            "default.replication.factor": str(self.replicas),
            "min.insync.replicas": min_isr,
            "offsets.topic.replication.factor": str(self.replicas),
            "offsets.topic.num.partitions": "5",
            "transaction.state.log.replication.factor": str(self.replicas),
            "transaction.state.log.min.isr": min_isr,
            "transaction.state.log.num.partitions": "3",
            "group.initial.rebalance.delay.ms": "0",
            # Kafka is the source of truth: keep the log, so `replay` can rebuild everything
            "log.retention.ms": "-1",
            "log.retention.bytes": "-1",
        }
        if self.sasl_users:
            props["listeners"] += f",SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}"
            props["advertised.listeners"] += f",SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}"
            props["listener.security.protocol.map"] += ",SASL_PLAINTEXT:SASL_PLAINTEXT"
            props["sasl.enabled.mechanisms"] = "PLAIN"
            users = " ".join(f'user_{u}="{pw}"' for u, pw in self.sasl_users.items())
            props["listener.name.sasl_plaintext.plain.sasl.jaas.config"] = (
                "org.apache.kafka.common.security.plain.PlainLoginModule required " + users + ";")
        if self.secured:
            props.update(self._secured_props())
        config = self.data_dir / "server.properties"
        config.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        config.chmod(0o600)  # a secured broker's file holds the super user's password
        (self.data_dir / "log4j.properties").write_text(
            "log4j.rootLogger=INFO, file\n"
            "log4j.appender.file=org.apache.log4j.FileAppender\n"
            f"log4j.appender.file.File={self.log_file}\n"
            "log4j.appender.file.layout=org.apache.log4j.PatternLayout\n"
            "log4j.appender.file.layout.ConversionPattern=[%d] %p %m (%c)%n\n"
            "log4j.logger.kafka=INFO\nlog4j.logger.org.apache.kafka=INFO\n"
        )
        return config

    def _secured_props(self) -> dict[str, str]:
        """SCRAM on the one client listener (also the brokers' own), PLAIN between broker and
        controller (SCRAM credentials live in the metadata the controller serves), ACLs enforced."""
        admin, password = self.super_user, self.scram_users[self.super_user]
        return {
            "listeners": f"SASL_PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"SASL_PLAINTEXT://127.0.0.1:{self.port}",
            "listener.security.protocol.map": "CONTROLLER:SASL_PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT",
            "inter.broker.listener.name": "SASL_PLAINTEXT",
            "sasl.enabled.mechanisms": "SCRAM-SHA-256,SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol": "SCRAM-SHA-256",
            "listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config":
                f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{admin}" '
                f'password="{password}";',
            "listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "sasl.mechanism.controller.protocol": "PLAIN",
            "listener.name.controller.sasl.enabled.mechanisms": "PLAIN",
            "listener.name.controller.plain.sasl.jaas.config":
                f'org.apache.kafka.common.security.plain.PlainLoginModule required username="{admin}" '
                f'password="{password}" user_{admin}="{password}";',
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users": f"User:{admin}",
            "allow.everyone.if.no.acl.found": "false",
        }

    def _java(self, jars: Path, main: str, *args: str) -> list[str]:
        return [
            "java", *self.stack.kafka_heap.split(), "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j.configuration=file:{self.data_dir / 'log4j.properties'}",
            "-cp", f"{jars}/*", main, *args,
        ]

    def _format(self, jars: Path, config: Path) -> None:
        if (self.data_dir / "logs" / "meta.properties").exists():
            return  # formatted earlier: keep the data
        cluster_id = self.cluster_id or uuid.uuid4().hex[:22]
        scram = [arg for user, pw in self.scram_users.items() for mech in ("SCRAM-SHA-256", "SCRAM-SHA-512")
                 for arg in ("--add-scram", f"{mech}=[name={user},password={pw}]")]
        result = subprocess.run(
            self._java(jars, "kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config), *scram),
            capture_output=True, text=True,
        )
        if result.returncode != 0:
            out = result.stdout + result.stderr
            for pw in self.scram_users.values():
                out = out.replace(pw, "***")
            raise RuntimeError(f"StorageTool format failed: {out}")

    def start(self, timeout: float = 60.0, detach: bool = False) -> None:
        """Format (first time) and start; returns when the broker serves metadata."""
        self.launch(detach)
        self.wait_ready(timeout)

    def launch(self, detach: bool = False) -> None:
        """Format (first time) and start the process; does not wait (a cluster starts all nodes first)."""
        jars = ensure_jars(self.stack)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self._write_config()
        self._format(jars, config)
        out = open(self.data_dir / "broker.stdout", "ab")
        self.process = subprocess.Popen(
            self._java(jars, "kafka.Kafka", str(config)),
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=detach,
        )
        out.close()

    def wait_ready(self, timeout: float, peers: Sequence[int] = ()) -> None:
        """Until this node answers metadata requests and lists itself (and `peers`: these broker
        ids too) among the live brokers."""
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"Kafka broker exited with {self.process.returncode}; see {self.log_file}")
            if port_open("127.0.0.1", self.port):
                try:
                    admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=3000,
                                             **self.admin_config())
                    try:
                        brokers = admin.describe_cluster().get("brokers", [])
                        if {self.node_id, *peers} <= {b.get("broker_id") for b in brokers}:
                            return
                    finally:
                        admin.close()
                except KafkaError:
                    pass
            time.sleep(0.2)
        raise TimeoutError(f"Kafka broker not ready after {timeout:.0f}s; see {self.log_file}")

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault tests); `start()` brings it back on its data."""
        if self.process is None:
            return
        self.process.kill()
        self.process.wait(30)
        self.process = None

    def stop(self, timeout: float = 30.0) -> None:
        if self.process is None:
            return
        stop_pid(self.process.pid, timeout)
        try:
            self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        self.process = None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] != "Z"
    except OSError:
        return True


def stop_pid(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM, wait up to `timeout`, then SIGKILL."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    # until the kernel has torn it down: its ports are free only then (a restart reuses them)
    deadline = time.monotonic() + 10.0
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def create_topics(bootstrap: str, topics: Sequence[str | TopicSpec], partitions: int = 3,
                  timeout: float = 30.0, client_config: dict[str, object] | None = None) -> None:
    """Create the topics that do not exist yet; waits until they are visible.

    `topics`: specs (`Topics.specs(settings)`: replication, min ISR, retention) or bare
    names, which get the broker's defaults. `client_config`: security settings in
    kafka-python's spelling (a secured broker's `admin_config()`).
    """
    from kafka import KafkaAdminClient

    from areal_metrics.producers.runtime.topic_admin import create_missing_topics

    specs = [t if isinstance(t, TopicSpec) else TopicSpec(t, -1) for t in topics]
    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), request_timeout_ms=int(timeout * 1000),
                             **(client_config or {}))
    try:
        create_missing_topics(admin, specs, partitions, timeout=timeout)
    finally:
        admin.close()
