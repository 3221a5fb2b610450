"""What the framework integration tests (tests/test_integration_*.py) share.

- Nothing downloads: the Hugging Face offline switches are set when this module
  is imported, at collection, before any test imports huggingface_hub (which
  reads them once, at its import); subprocesses get them through `OFFLINE`.
- `publish_commands`: control commands for a run, as the CLI's `control` verb sends them.
- `rows_when`: the rows of a query once the sink has projected enough of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from kafka import KafkaProducer

from producers.events import CommandEvent
from producers.topics import Topics
from tests.test_client_broker import wait_for

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
os.environ.update(OFFLINE)


def publish_commands(bootstrap: str, topics: Topics, run_id: str, commands: tuple[str, ...]) -> None:
    """Commands for a run that has started: it reads the control topic from its start, so none is missed."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for command in commands:
        event = CommandEvent(run_id=run_id, command=command, reason="test")
        producer.send(topics.control, key=run_id.encode(), value=event.to_json())
    producer.flush(30)
    producer.close()


def rows_when(sink: Callable[[str], list[tuple]], sql: str, count: int, what: str, timeout: float = 120) -> list[tuple]:
    """The rows of `sql` once there are `count` of them (the sink projects asynchronously)."""
    wait_for(lambda: len(sink(sql)) >= count, timeout, what)
    return sink(sql)
