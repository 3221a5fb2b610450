"""`alerts --webhook URL` against a local HTTP server (CONTRACT.md, 'Adoption').

- The body: JSON with a human `text` (Slack's incoming-webhook field) and the alert.
- Retries: a receiver that answers 503 twice gets the alert on the third try, once; a 404
  stops with exit status 1 and commits nothing.
- End to end: a step with a NaN reward -> the real stream worker's `non_finite` alert -> the
  subscriber POSTs it (through one 503); the subscriber is killed, two alerts arrive while it
  is away, and the restarted subscriber posts exactly those two: none lost, none twice.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from areal_metrics.commands.webhook import Poster, group_for, text
from areal_metrics.errors import ServiceUnavailable
from areal_metrics.producers.contract.events import AlertEvent
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from tests import integration_support
from tests.support import ROOT, child_env, wait_for
from tests.test_sink_broker import lag

stream_worker = integration_support.stream_worker


class Receiver:
    """A local webhook: records every body it accepts; answers `fail_with` to the first `failures` requests."""

    def __init__(self, failures: int = 0, fail_with: int = 503) -> None:
        self.bodies: list[dict] = []
        self.requests = 0
        self.failures, self.fail_with = failures, fail_with
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.requests += 1
                if receiver.requests <= receiver.failures:
                    self.send_response(receiver.fail_with)
                else:
                    receiver.bodies.append({**json.loads(raw), "_key": self.headers["Idempotency-Key"]})
                    self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def ids(self) -> list[str]:
        return [b["alert"]["alert_id"] for b in self.bodies]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def alert(i: int = 0, run_id: str = "r1") -> AlertEvent:
    return AlertEvent(run_id=run_id, kind="non_finite", severity="warning", message=f"NaN in reward ({i})", step=i,
                      node="h:0", alert_id=f"a{i}")


def test_the_body_is_slack_compatible_and_names_the_alert(receiver: Receiver) -> None:
    assert Poster(receiver.url).post(alert(3)) == 1
    [got] = receiver.bodies
    assert got["text"] == text(alert(3)) == "[warning] non_finite · run r1 · step 3 · node h:0: NaN in reward (3)"
    assert got["alert"]["alert_id"] == got["_key"] == "a3" and got["alert"]["kind"] == "non_finite"


def test_what_can_pass_is_retried_with_backoff_and_delivered_once() -> None:
    flaky = Receiver(failures=2)
    waits: list[float] = []
    try:
        assert Poster(flaky.url, sleep=waits.append).post(alert()) == 3
        assert flaky.requests == 3 and flaky.ids() == ["a0"] and waits == [0.5, 1.0]
    finally:
        flaky.server.shutdown()


def test_a_refusal_that_cannot_pass_stops_with_one_line() -> None:
    wrong = Receiver(failures=1, fail_with=404)
    try:
        with pytest.raises(ServiceUnavailable, match="HTTP 404"):
            Poster(wrong.url, sleep=lambda s: None).post(alert())
        assert wrong.requests == 1
    finally:
        wrong.server.shutdown()


def subscriber(env: dict[str, str], url: str, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "areal_metrics", "alerts", "--follow", "--kind", "non_finite",
                             "--webhook", url],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)


@pytest.mark.broker
@pytest.mark.timeout(400)
def test_a_non_finite_alert_reaches_the_webhook_and_a_restart_neither_loses_nor_repeats(
        stack_env: dict[str, str], topics: Topics, tmp_path: Path, stream_worker) -> None:
    from areal_metrics.producers.delivery.publisher import Publisher

    hook = Receiver(failures=1)  # the first POST answers 503: retried
    env = child_env(stack_env)
    try:
        first = subscriber(env, hook.url, tmp_path / "sub1.log")
        trainer = subprocess.run([sys.executable, "-c", (
            "import areal_metrics as am\n"
            "run = am.init(run_id='hooked', world_size=1, git=False)\n"
            "run.log({'reward': float('nan'), 'loss': 0.5}, step=0)\n"
            "run.finish()\n")], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert trainer.returncode == 0, trainer.stderr[-2000:]
        wait_for(lambda: hook.bodies, 180, "the non_finite alert at the webhook")
        [got] = hook.bodies
        assert got["alert"]["kind"] == "non_finite" and got["alert"]["run_id"] == "hooked"
        assert "non_finite" in got["text"] and "reward" in got["text"] and hook.requests == 2
        # The receiver records the body before it answers, and the subscriber commits once it has the answer:
        # a kill in between is at-least-once's window (the alert is posted again), so wait for the commit.
        wait_for(lambda: lag(stack_env["AREAL_KAFKA_BOOTSTRAP"], topics, group_for(hook.url), [topics.alerts]) == 0,
                 60, "the subscriber's commit of the delivered alert")
        first.kill()  # no goodbye: what it delivered is committed already
        first.wait()

        settings = Settings(kafka_bootstrap=stack_env["AREAL_KAFKA_BOOTSTRAP"], topic_prefix=topics.prefix)
        publisher = Publisher.from_settings(settings, journal_dir=tmp_path / "journal")
        for i in (1, 2):  # while no subscriber runs
            publisher.publish(alert(i, run_id="hooked"))
        assert publisher.flush(60)
        publisher.close()

        second = subscriber(env, hook.url, tmp_path / "sub2.log")
        try:
            wait_for(lambda: len(hook.bodies) >= 3, 120, "the two alerts raised while the subscriber was away")
            with pytest.raises(subprocess.TimeoutExpired):
                second.wait(timeout=5)  # still following; nothing more arrives
            assert hook.ids() == [got["alert"]["alert_id"], "a1", "a2"]
        finally:
            second.kill()
            second.wait()
    finally:
        hook.server.shutdown()
