"""A stop signal ends the stream worker within AREAL_WORKER_STOP_TIMEOUT_S, also while Kafka is gone;
meanwhile its log stays small (AREAL_LOG_REPEAT_S: its Kafka client wrote ~100 lines a second).

Faust's clean stop (a last flush and offset commit) waited for good on an unreachable broker:
a worker was still in `stop_and_shutdown` 70 s after its SIGTERM. The bound is
streams/shell/faust_internals.py `BoundedStopWorker`. A private broker, so that killing it
disturbs no other test.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from areal_metrics.producers.contract.topics import Topics
from areal_metrics.stack.kafka_broker import KafkaBroker
from areal_metrics.stack.settings import StackSettings
from areal_metrics.streams.shell.app import app_id_for
from tests.support import group_members_when, service_env, start_service

pytestmark = pytest.mark.broker

BOUND_S = 3


def test_a_sigterm_ends_the_worker_within_its_bound_and_its_log_stays_small_while_the_broker_is_gone(tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path / "kafka", stack=StackSettings.from_env())
    broker.start(timeout=120)
    topics = Topics("stopbound.")
    env = service_env(broker.bootstrap, topics.prefix, tmp_path, AREAL_WORKER_STOP_TIMEOUT_S=str(BOUND_S),
                      AREAL_LOG_REPEAT_S="60")
    log = tmp_path / "worker.log"
    worker = start_service("areal_metrics.streams", env, log)
    try:
        joined = group_members_when(broker.bootstrap, app_id_for(topics.prefix), 1, timeout=120)
        assert joined == 1 and worker.poll() is None, log.read_text()[-3000:]
        before = len(log.read_text().splitlines())
        broker.kill()
        time.sleep(5)  # the worker's connections see the broker gone, and keep trying
        lines_while_gone = len(log.read_text().splitlines()) - before
        started = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        try:
            code = worker.wait(timeout=BOUND_S + 30)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - started
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        broker.stop()
    text = log.read_text()
    assert code is not None and took < BOUND_S + 7, f"still running {took:.0f} s after SIGTERM: {text[-3000:]}"
    # Within the bound it either stopped cleanly (0) or was ended by it (1, saying why).
    assert code == 0 or (code == 1 and f"not stopped {BOUND_S} s after SIGTERM" in text), (code, text[-3000:])
    # each failing call once (about ten kinds), not ~500 lines in 5 s
    assert lines_while_gone <= 40, text[-3000:]
