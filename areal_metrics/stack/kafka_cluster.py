"""A Kafka cluster of three (or more) KRaft nodes from the same jars as the single broker.

Each node is a combined broker+controller (`process.roles=broker,controller`), and the
three controllers form the metadata quorum. Why combined rather than 3 brokers beside a
separate controller quorum: three JVMs instead of six on a laptop or a 2-core CI box,
and the same fault tolerance for what is tested here: with one node down (SIGKILL),
two of three voters keep a quorum, and two of three replicas satisfy
`min.insync.replicas=2`, so writes with acks=all go on. (Kafka advises dedicated
controllers in production; a production cluster is configured by its operators, and
this project only needs its clients to work against one.)

Every node keeps its ports and data across restarts, so `start_node(i)` after a
`kill(i)` brings the same broker back, which catches up from the others.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from areal_metrics.stack.kafka_broker import KafkaBroker, free_port, stop_pid
from areal_metrics.stack.settings import StackSettings


def _formatted_cluster_id(node_dir: Path) -> str | None:
    """The cluster id a node was formatted with, None when not formatted yet."""
    try:
        text = (node_dir / "logs" / "meta.properties").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("cluster.id="):
            return line.split("=", 1)[1].strip()
    return None


@dataclass
class KafkaCluster:
    """`size` broker+controller nodes under `data_dir/node-<id>/`, on loopback ports.

    `ports`: (client port, controller port) per node, to reuse the ports of an earlier
    start (0 or missing: a free port).
    """

    data_dir: Path
    size: int = 3
    partitions: int = 3
    ports: list[tuple[int, int]] = field(default_factory=list)
    nodes: list[KafkaBroker] = field(default_factory=list, repr=False)
    stack: StackSettings = field(default_factory=StackSettings, repr=False)  # each node's JVM heap and jars

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a cluster needs at least one node (got {self.size})")
        self.data_dir = Path(self.data_dir).absolute()
        ports = list(self.ports) + [(0, 0)] * (self.size - len(self.ports))
        ports = [(p or free_port(), c or free_port()) for p, c in ports[: self.size]]
        self.ports = ports
        voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports))
        dirs = [self.data_dir / f"node-{i + 1}" for i in range(self.size)]
        # every node must carry the same cluster id: reuse the one an earlier start formatted with
        cluster_id = next(filter(None, map(_formatted_cluster_id, dirs)), None) or uuid.uuid4().hex[:22]
        self.nodes = [
            KafkaBroker(d, port=p, controller_port=c, partitions=self.partitions, node_id=i + 1, voters=voters,
                        cluster_id=cluster_id, replicas=self.size, stack=self.stack)
            for i, (d, (p, c)) in enumerate(zip(dirs, ports))
        ]

    @property
    def bootstrap(self) -> str:
        """Every node's address: a client reaches the cluster through any node that is up."""
        return ",".join(n.bootstrap for n in self.nodes)

    def start(self, timeout: float = 120.0, detach: bool = False) -> None:
        """Start every node (all first: none is ready before a quorum is), then wait until each
        lists all of them: a node that answers before it has heard of the others can name a
        controller it has no address for, and an admin request to it fails (seen in CI)."""
        for node in self.nodes:
            if node.process is None:
                node.launch(detach)
        deadline = time.monotonic() + timeout
        try:
            ids = [n.node_id for n in self.nodes]
            for node in self.nodes:
                node.wait_ready(max(deadline - time.monotonic(), 1.0), peers=ids)
        except (RuntimeError, TimeoutError):
            self.stop()
            raise

    def kill(self, index: int) -> None:
        """SIGKILL node `index` (0-based), as a crash would."""
        self.nodes[index].kill()

    def start_node(self, index: int, timeout: float = 120.0) -> None:
        """Start node `index` again on its data; returns when it is back among the live brokers."""
        self.nodes[index].start(timeout=timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM every node at once (one by one, the last would wait for a quorum that is gone)."""
        running = [n for n in self.nodes if n.process is not None and n.process.poll() is None]
        for node in running:
            try:
                os.kill(node.process.pid, signal.SIGTERM)  # type: ignore[union-attr]
            except ProcessLookupError:
                pass
        for node in running:
            stop_pid(node.process.pid, timeout)  # type: ignore[union-attr]  # waits, then SIGKILL
        for node in self.nodes:
            if node.process is not None:
                try:
                    node.process.wait(timeout=5)
                except Exception:  # noqa: BLE001 - already reaped or stuck: nothing more to do
                    pass
            node.process = None

    def partition_leaders(self, topic: str) -> dict[int, int]:
        """{partition: index of the node that leads it} (-1: no leader now)."""
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap.split(","), request_timeout_ms=10_000)
        try:
            (desc,) = admin.describe_topics([topic])
        finally:
            admin.close()
        ids = [n.node_id for n in self.nodes]
        return {p["partition_index"]: ids.index(p["leader_id"]) if p["leader_id"] in ids else -1
                for p in desc["partitions"]}

    def wait_in_sync(self, topics: list[str], timeout: float = 120.0) -> None:
        """Until every partition of `topics` has all `size` replicas in sync (a restarted node caught up)."""
        from kafka import KafkaAdminClient

        deadline = time.monotonic() + timeout
        lagging: list[str] = []
        admin = KafkaAdminClient(bootstrap_servers=self.bootstrap.split(","), request_timeout_ms=10_000)
        try:
            while time.monotonic() < deadline:
                descs = admin.describe_topics(topics)
                lagging = [d["name"] for d in descs if d.get("error_code") or not d.get("partitions")]
                lagging += [f"{d['name']}[{p['partition_index']}]" for d in descs
                            for p in d.get("partitions") or () if len(p.get("isr_nodes") or ()) < self.size]
                if not lagging:
                    return
                time.sleep(0.5)
        finally:
            admin.close()
        raise TimeoutError(f"replicas not in sync after {timeout:.0f}s: {', '.join(lagging[:5])}")
