"""Container health of our services: `python docker/healthcheck.py streams|sink` exits 0 when healthy.

- streams: the worker's consumer group (the Faust app id) has members, so it is
  consuming areal.steps and areal.evals;
- sink: its consumer group has members and the ClickHouse tables exist (the
  sink applies the schema before it consumes).
"""

from __future__ import annotations

import sys


def group_has_members(group: str) -> bool:
    from kafka.admin import KafkaAdminClient
    from kafka.errors import KafkaError

    from areal_metrics.producers.contract.settings import Settings

    admin = KafkaAdminClient(**Settings.from_env().kafka_python_config(), request_timeout_ms=5000)
    try:
        info = admin.describe_groups([group]).get(group, {})
    except KafkaError:  # e.g. no coordinator yet on a fresh broker: nobody has joined
        return False
    finally:
        admin.close()
    state = info.get("group_state") or info.get("state")
    return not info.get("error") and bool(info.get("members")) and state in (None, "Stable", "CompletingRebalance")


def main(service: str) -> int:
    from areal_metrics.producers.contract.settings import Settings

    settings = Settings.from_env()
    if service == "streams":
        from areal_metrics.streams.shell.app import app_id_for

        return 0 if group_has_members(app_id_for(settings.topic_prefix)) else 1
    if service == "sink":
        from areal_metrics.sinks.query import connect
        from areal_metrics.sinks.sink import consumer_group

        with connect(settings) as store:
            if not int(store.command("EXISTS TABLE steps")):
                return 1
        return 0 if group_has_members(consumer_group(settings)) else 1
    print(f"usage: healthcheck.py streams|sink (got {service!r})", file=sys.stderr)
    return 2


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
    except Exception as exc:  # noqa: BLE001 - unhealthy, say why in `docker inspect`
        print(f"unhealthy: {exc}", file=sys.stderr)
        sys.exit(1)
