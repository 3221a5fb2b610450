"""The stream worker and the sink, started while their broker is away, wait for it (and then run, or
stop cleanly on a SIGTERM).

Before, the worker exited 2 (read by its supervisor as a configuration error: never restarted)
and the sink 1 with a traceback (restarted, then given up after AREAL_RESTART_MAX quick deaths).
producers/runtime/kafka_wait.py. A private broker, started only once both services are waiting.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from areal_metrics.stack.kafka_broker import KafkaBroker, free_port
from areal_metrics.stack.settings import StackSettings
from areal_metrics.streams.shell.app import app_id_for
from tests.support import group_members_when, service_env, start_service, stop_process, wait_for

pytestmark = pytest.mark.broker


def test_the_worker_and_the_sink_started_before_their_broker_wait_for_it(tmp_path: Path) -> None:
    broker = KafkaBroker(tmp_path / "kafka", stack=StackSettings.from_env())  # its port chosen, not started
    prefix = "waitk."
    env = service_env(broker.bootstrap, prefix, tmp_path)
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "sink")}
    worker = start_service("areal_metrics.streams", env, logs["worker"])
    sink = start_service("areal_metrics.sinks", env, logs["sink"])
    try:
        def both_waiting() -> bool:
            assert worker.poll() is None and sink.poll() is None, {n: p.read_text()[-2000:] for n, p in logs.items()}
            return all("Kafka not answering" in p.read_text() for p in logs.values())

        wait_for(both_waiting, 120, "both services to say Kafka is not answering")
        time.sleep(3)  # and to go on waiting
        assert worker.poll() is None and sink.poll() is None
        broker.start(timeout=120)
        assert group_members_when(broker.bootstrap, app_id_for(prefix), 1, timeout=180) == 1, \
            logs["worker"].read_text()[-3000:]
        wait_for(lambda: "sink running" in logs["sink"].read_text(), 180, "the sink to run")
        assert worker.poll() is None and sink.poll() is None
    finally:
        stop_process(worker)
        stop_process(sink)
        broker.stop()
    assert (worker.returncode, sink.returncode) == (0, 0), {n: p.read_text()[-2000:] for n, p in logs.items()}


def test_a_sigterm_while_they_wait_stops_both_cleanly(tmp_path: Path) -> None:
    import signal

    nowhere = f"127.0.0.1:{free_port()}"  # nothing will listen there
    env = service_env(nowhere, "waitk2.", tmp_path)
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "sink")}
    procs = {"worker": start_service("areal_metrics.streams", env, logs["worker"]),
             "sink": start_service("areal_metrics.sinks", env, logs["sink"])}
    try:
        wait_for(lambda: all("no broker accepts a connection at " + nowhere in p.read_text() for p in logs.values()),
                 120, "both services to wait")
        started = time.monotonic()
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        codes = {name: proc.wait(timeout=30) for name, proc in procs.items()}
        took = time.monotonic() - started
    finally:
        for proc in procs.values():
            stop_process(proc)
    texts = {n: p.read_text() for n, p in logs.items()}
    assert codes == {"worker": 0, "sink": 0} and took < 15, (codes, took, {n: t[-1500:] for n, t in texts.items()})
    assert not any("Traceback" in t for t in texts.values()), texts
