"""What the framework integration tests (tests/test_integration_*.py) share.

- Nothing downloads: the Hugging Face offline switches are set when this module
  is imported, at collection, before any test imports huggingface_hub (which
  reads them once, at its import); subprocesses get them through `OFFLINE`.
- `publish_commands`: control commands for a run, as the CLI's `control` verb sends them.
- `rows_when`: the rows of a query once the sink has projected enough of them.
- `stream_worker`: the fixture of the real stream worker as a process (a
  test module takes it as `stream_worker = integration_support.stream_worker`).
- `torchrun_obeying`: 2 processes under torchrun that get `evaluate_now` and
  `stop` once rank 0 says it is ready.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kafka import KafkaProducer

from areal_metrics.producers.contract.events import CommandEvent
from areal_metrics.producers.contract.topics import Topics
from tests.support import ROOT, child_env, start_service, stop_process, wait_for

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
os.environ.update(OFFLINE)


@pytest.fixture
def stream_worker(stack_env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The real stream worker as a process (its log: tmp_path / "worker.log"), stopped at teardown."""
    proc = start_service("areal_metrics.streams", stack_env, tmp_path / "worker.log")
    yield proc
    stop_process(proc)


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


def torchrun_obeying(args: list[str], stack_env: dict[str, str], topics: Topics, run_id: str, ready: list[str],
                     log: Path, timeout: float) -> str:
    """`args` under torchrun, 2 processes; `evaluate_now` and `stop` once rank 0 prints `ready`; their stdout."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(stack_env, **OFFLINE), stdout=subprocess.PIPE,
                            stderr=log.open("w"), text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().split() == ready, log.read_text()[-4000:]
        publish_commands(stack_env["AREAL_KAFKA_BOOTSTRAP"], topics, run_id, ("evaluate_now", "stop"))
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, log.read_text()[-4000:]
        return out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
