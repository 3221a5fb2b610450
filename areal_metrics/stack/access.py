"""Least privilege: what each component may do on Kafka and ClickHouse, from one table.

`components()` is that table (pure): per component, the Kafka ACLs it needs (topics, consumer
groups; no component uses transactions, so no transactional ids) and the ClickHouse grants.
docs/SECURITY.md shows it (`python -m areal_metrics.stack.access` prints the section, and
tests/test_access.py holds the page to it); `apply_acls()` creates its ACLs on a broker with
kafka-python's admin API (tests/test_secured_broker.py runs the pipeline under them).

Derived from the code of each component:

- trainer client (`producers/client`, `producers/delivery`): writes steps, evals, runs,
  acks (its answers to commands), alerts (`run.alert`) and dead letters (what it could not
  encode); reads `control` (`run.commands()`) and `runs`
  (resume: its earlier attempts), both without a consumer group.
- stream worker (`python -m areal_metrics.streams`, Faust): reads steps, evals, runs, acks; writes
  smoothed rewards, consensus, commands (closed loop), alerts, dead letters; its group and its
  own topics (ticks, the table's changelog, Faust's assignor topic) are named after the app id
  (`streams.shell.app.app_id_for`), and it creates the own topics that are missing.
- sink (`python -m areal_metrics.sinks`): reads every topic of the prefix in its group
  (`sinks.sink.consumer_group`), writes dead letters, and a `poison_message` alert when a
  message crashed it twice.
- `alerts --follow`: reads `alerts`; with `--group NAME` (or `--webhook`, whose group is
  `areal-alerts-webhook-<hash>`), commits in that group.
- people's `publish`: writes commands (`control`), and dead letters for lines it refuses.
- `watch`: reads smoothed, consensus, control, alerts and runs, without a group.
- `replay`: reads every topic without a group; rebuilds the tables (the sink's grants).

Topics themselves are created by the admin (`areal-metrics up`, or whoever runs the broker);
Kafka ACLs name topics and groups, never message keys, so a principal that may write a topic
may write any run's key there (docs/SECURITY.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from areal_metrics.producers.contract.topics import Topics

READ, WRITE, CREATE, DESCRIBE_CONFIGS = "READ", "WRITE", "CREATE", "DESCRIBE_CONFIGS"
TOPIC, GROUP = "TOPIC", "GROUP"


@dataclass(frozen=True, slots=True)
class KafkaGrant:
    """ALLOW `operations` on one resource (a topic or a group; `prefixed`: every name starting with `name`).

    Kafka's READ and WRITE imply DESCRIBE (metadata, offsets), so no grant names it."""

    resource: str  # TOPIC or GROUP
    name: str
    operations: tuple[str, ...]
    prefixed: bool = False


@dataclass(frozen=True, slots=True)
class Component:
    name: str
    what: str  # who runs it, for the docs
    kafka: tuple[KafkaGrant, ...]
    clickhouse: tuple[str, ...] = ()  # GRANT statements (`{user}` stands for its user)


def worker_group(prefix: str) -> str:
    """The stream worker's consumer group, which also names its own topics (the Faust app id)."""
    from areal_metrics.streams.shell.app import app_id_for

    return app_id_for(prefix)


def sink_group(prefix: str) -> str:
    from areal_metrics.producers.contract.settings import Settings
    from areal_metrics.sinks.sink import consumer_group

    return consumer_group(Settings(topic_prefix=prefix))


def _topics(names: Iterable[str], *operations: str) -> tuple[KafkaGrant, ...]:
    return tuple(KafkaGrant(TOPIC, n, operations) for n in names)


def clickhouse_grants(database: str) -> dict[str, tuple[str, ...]]:
    """The ClickHouse grants of the store's writers (sink, replay) and readers (Grafana, `sql`, `report`)."""
    db = database
    writer = (
        # the schema and its migrations (sinks/migrations.py): tables, views, new columns, TTLs,
        # re-keyed copies (INSERT ... SELECT, EXCHANGE TABLES, DROP of the old copy)
        f"GRANT CREATE DATABASE ON {db}.* TO {{user}}",
        f"GRANT CREATE TABLE, CREATE VIEW, DROP TABLE, DROP VIEW, ALTER TABLE, ALTER VIEW ON {db}.* TO {{user}}",
        f"GRANT INSERT, SELECT ON {db}.* TO {{user}}",
    )
    reader = (f"GRANT SELECT ON {db}.* TO {{user}}",)
    return {"writer": writer, "reader": reader}


def components(topics: Topics, *, worker: str, sink: str, alerts_group: str | None = None,
               database: str = "areal") -> dict[str, Component]:
    """Each component's grants for one topic prefix (pure). `worker`, `sink`: their consumer groups
    (`worker_group(prefix)`, `sink_group(prefix)`); `alerts_group`: the `--group` of `alerts`, if any."""
    t = topics
    ch = clickhouse_grants(database)
    alerts_grants = _topics([t.alerts], READ)
    if alerts_group:
        alerts_grants += (KafkaGrant(GROUP, alerts_group, (READ,)),)
    table = [
        Component("trainer", "the client in a training process (`areal_metrics.init`, `run.log`)",
                  # acks: its answers to commands; alerts: `run.alert` (the user's own conditions)
                  _topics([t.steps, t.evals, t.runs, t.acks, t.alerts, t.deadletter], WRITE)
                  + _topics([t.control, t.runs], READ)),
        Component("worker", "the stream worker (`python -m areal_metrics.streams`)",
                  _topics([t.steps, t.evals, t.runs, t.acks], READ)
                  + _topics([t.smoothed, t.consensus, t.control, t.alerts, t.deadletter], WRITE)
                  # its own topics; DESCRIBE_CONFIGS: its changelog's max.message.bytes, which bounds its state records
                  + (KafkaGrant(TOPIC, f"{worker}-", (READ, WRITE, CREATE, DESCRIBE_CONFIGS), prefixed=True),
                     KafkaGrant(GROUP, worker, (READ,)))),
        Component("sink", "the ClickHouse sink (`python -m areal_metrics.sinks`)",
                  # alerts: poison_message, when a message crashed the sink twice (producers/runtime/poison.py)
                  _topics(t.all(), READ) + _topics([t.alerts, t.deadletter], WRITE) + (KafkaGrant(GROUP, sink, (READ,)),),
                  ch["writer"]),
        Component("alerts", "`areal-metrics alerts --follow` (and `--webhook`)", alerts_grants),
        Component("publish", "people's `areal-metrics publish` (commands)", _topics([t.control, t.deadletter], WRITE)),
        Component("watch", "`areal-metrics watch`",
                  _topics([t.smoothed, t.consensus, t.control, t.alerts, t.runs], READ)),
        Component("replay", "`areal-metrics replay` (rebuilds the tables from Kafka)", _topics(t.all(), READ),
                  ch["writer"]),
        Component("reader", "Grafana, `sql`, `report`: the store's readers", (), ch["reader"]),
    ]
    return {c.name: c for c in table}


def kafka_acls(principal: str, grants: Iterable[KafkaGrant]) -> list[Any]:
    """kafka-python ACL objects for one principal ("User:NAME"), one per operation, from any host."""
    from kafka.admin import (
        ACL,
        ACLOperation,
        ACLPermissionType,
        ACLResourcePatternType,
        ResourcePattern,
        ResourceType,
    )

    return [ACL(principal, "*", ACLOperation[op], ACLPermissionType.ALLOW,
                ResourcePattern(ResourceType[g.resource], g.name,
                                ACLResourcePatternType.PREFIXED if g.prefixed else ACLResourcePatternType.LITERAL))
            for g in grants for op in g.operations]


def apply_acls(admin: Any, users: Mapping[str, str], table: Mapping[str, Component]) -> int:
    """Create the ACLs of each component named in `users` (component -> user name) with a kafka-python
    `KafkaAdminClient` of a super user; returns how many. RuntimeError naming the first refused ACL."""
    acls = [acl for name, user in users.items() for acl in kafka_acls(f"User:{user}", table[name].kafka)]
    result = admin.create_acls(acls)
    failed = result.get("failed") or []  # kafka-python: the error of each refused ACL
    if failed:
        refused = [acl for acl in acls if acl not in result.get("succeeded", [])]
        raise RuntimeError(f"the broker refused {len(failed)} ACL(s), the first {refused[:1]}: {failed[0]}")
    return len(acls)


def markdown(table: Mapping[str, Component]) -> str:
    """The tables docs/SECURITY.md shows: per component, what it reads, writes, commits in and creates
    on Kafka, and its ClickHouse grants."""

    def names(c: Component, resource: str, op: str) -> str:
        found = [f"`{g.name}`" + ("…" if g.prefixed else "") for g in c.kafka
                 if g.resource == resource and op in g.operations]
        return ", ".join(found) or "-"

    lines = ["| component | READ (topics) | WRITE (topics) | CREATE (topics) | DESCRIBE_CONFIGS (topics) "
             "| READ (consumer group) |",
             "|---|---|---|---|---|---|"]
    for c in table.values():
        lines.append(f"| {c.name} | {names(c, TOPIC, READ)} | {names(c, TOPIC, WRITE)} | {names(c, TOPIC, CREATE)} "
                     f"| {names(c, TOPIC, DESCRIBE_CONFIGS)} | {names(c, GROUP, READ)} |")
    lines += ["", "| component | who | ClickHouse grants |", "|---|---|---|"]
    for c in table.values():
        lines.append(f"| {c.name} | {c.what} | " + ("<br>".join(f"`{g}`" for g in c.clickhouse) or "none") + " |")
    return "\n".join(lines) + "\n"


def documented_table() -> dict[str, Component]:
    """The table for the default prefix, as docs/SECURITY.md shows it (`alerts --group NAME`)."""
    topics = Topics()
    return components(topics, worker=worker_group(topics.prefix), sink=sink_group(topics.prefix), alerts_group="NAME")


if __name__ == "__main__":
    print(markdown(documented_table()), end="")
