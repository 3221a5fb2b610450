"""Least privilege against a real secured broker (docs/SECURITY.md).

One broker for the module: SASL/SCRAM only, the standard KRaft authorizer,
`allow.everyone.if.no.acl.found=false`, an `admin` super user that creates the topics and
the ACLs. Each component has its own principal with exactly the ACLs of
`areal_metrics.stack.access.components()` (the table the docs show): a trainer logs through
the public client, the worker and the sink run as processes, people publish a command and
follow alerts through the CLI. A client without credentials, or with a wrong password, is
refused; the trainer cannot write commands nor read alerts unless granted; no password
reaches the services' logs or `status --json`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError, TopicAuthorizationFailedError

from areal_metrics.producers.contract.events import AlertEvent, CommandEvent, StepEvent, parse_event
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.stack import access
from areal_metrics.stack.kafka_broker import KafkaBroker, create_topics, kafka_version
from areal_metrics.stack.services import StackInfo, write_info
from areal_metrics.stack.settings import StackSettings
from tests.support import CLI, ROOT, cli, start_service, stop_process, wait_for

pytestmark = pytest.mark.broker

# One principal per component; each password is distinct, so a leak names its component.
USERS = {"admin": "pw-admin-5b1d", "trainer": "pw-trainer-93ce", "worker": "pw-worker-0a7f",
         "sink": "pw-sink-c44e", "alerts": "pw-alerts-71d2", "publish": "pw-publish-e80b",
         "watch": "pw-watch-3a90", "replay": "pw-replay-d6b7",
         "granted": "pw-granted-2f69"}  # granted: the trainer's ACLs plus READ on the alerts topic
ALERTS_GROUP = "secured-alerts"


@dataclass
class Secured:
    broker: KafkaBroker
    topics: Topics
    table: dict[str, access.Component]

    def config(self, user: str, password: str | None = None) -> dict[str, object]:
        """kafka-python settings of one principal (another password: a wrong one)."""
        return {"bootstrap_servers": self.broker.bootstrap, "security_protocol": "SASL_PLAINTEXT",
                "sasl_mechanism": "SCRAM-SHA-256", "sasl_plain_username": user,
                "sasl_plain_password": USERS[user] if password is None else password}

    def env(self, user: str, home: Path, **extra: str) -> dict[str, str]:
        """The environment of a process running as `user` (its password from a file, as a deployment would)."""
        secret = home / "secrets" / user
        secret.parent.mkdir(parents=True, exist_ok=True)
        secret.write_text(USERS[user] + "\n")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_KAFKA_SASL")}
        env.update(AREAL_KAFKA_BOOTSTRAP=self.broker.bootstrap, AREAL_TOPIC_PREFIX=self.topics.prefix,
                   AREAL_KAFKA_SECURITY_PROTOCOL="SASL_PLAINTEXT", AREAL_KAFKA_SASL_MECHANISM="scram-sha-256",
                   AREAL_KAFKA_SASL_USERNAME=user, AREAL_KAFKA_SASL_PASSWORD_FILE=str(secret),
                   AREAL_HOME=str(home), AREAL_CLICKHOUSE_URL=f"chdb://{home / 'clickhouse'}",
                   PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **extra)
        return env


@pytest.fixture(scope="module")
def secured(request: pytest.FixtureRequest) -> Iterator[Secured]:
    data_dir = Path(tempfile.mkdtemp(prefix="areal-test-kafka-secured-"))
    broker = KafkaBroker(data_dir, scram_users=USERS, super_user="admin", stack=StackSettings.from_env())
    broker.start(timeout=120)
    try:
        topics = Topics(f"s{uuid.uuid4().hex[:10]}.")
        create_topics(broker.bootstrap, topics.all(), partitions=3, client_config=broker.admin_config())
        table = access.components(topics, worker=access.worker_group(topics.prefix),
                                  sink=access.sink_group(topics.prefix), alerts_group=ALERTS_GROUP)
        granted = access.Component("granted", "a trainer also allowed to read alerts",
                                   table["trainer"].kafka + (access.KafkaGrant(access.TOPIC, topics.alerts, ("READ",)),))
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap, **broker.admin_config())
        try:
            users = {name: name for name in ("trainer", "worker", "sink", "alerts", "publish", "watch", "replay",
                                             "granted")}
            assert access.apply_acls(admin, users, {**table, "granted": granted}) > 0
        finally:
            admin.close()
        yield Secured(broker, topics, table)
    finally:
        broker.stop()
        if request.session.testsfailed:
            print(f"\nsecured Kafka logs kept at {data_dir / 'broker.log'}")
        else:
            shutil.rmtree(data_dir, ignore_errors=True)


TRAINER = """
import json, sys, time
import areal_metrics as am
run = am.init(run_id=sys.argv[1], config={"lr": 1e-5})
rewards = json.loads(sys.argv[2])
for step, reward in enumerate(rewards):
    run.log({"reward": reward, "loss": 1.0 / (step + 1)}, step=step)
run.commands()  # starts reading the control topic
print("logged", flush=True)
deadline = time.monotonic() + 90
got = []
while not got and time.monotonic() < deadline:
    got = [c.command for c in run.commands()]
    time.sleep(0.2)
print("commands " + json.dumps(got), flush=True)
run.finish()
"""


def _cli_started(*args: str, env: dict[str, str], input: str = "") -> subprocess.Popen[str]:
    """`areal-metrics ARGS` started now, to be collected with .communicate() (tests run such checks side by side)."""
    with tempfile.TemporaryFile("w+") as stdin:
        stdin.write(input)
        stdin.seek(0)
        return subprocess.Popen([*CLI, *args], env=env, text=True, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)


def _no_secret(text: str, where: str) -> None:
    leaked = [user for user, password in USERS.items() if password in text]
    assert not leaked, f"the password of {leaked} appears in {where}"


def test_pipeline_runs_with_one_principal_per_component(secured: Secured, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "areal"
    logs = home / "logs"  # where `areal-metrics status` reads the services' logs
    logs.mkdir(parents=True)
    worker = start_service("areal_metrics.streams", secured.env("worker", home, AREAL_STREAMS_LOGLEVEL="info"),
                           logs / "worker.log")
    sink = start_service("areal_metrics.sinks", secured.env("sink", home, AREAL_LOG_LEVEL="info"), logs / "sink.log")
    trainer = None
    try:
        run_id = f"secured-{uuid.uuid4().hex[:6]}"
        rewards = [round(0.1 * i + (0.05 if i % 2 else 0.0), 3) for i in range(12)]
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, run_id, json.dumps(rewards)],
                                   env=secured.env("trainer", home), cwd=ROOT, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert trainer.stdout is not None
        first = trainer.stdout.readline()
        assert first.strip() == "logged", first + trainer.stdout.read()[-3000:]
        # people steer the run: `publish` as its own principal; the trainer reads the command
        command = CommandEvent(run_id=run_id, command="evaluate_now", reason="secured test").to_dict()
        published = cli("publish", "-", env=secured.env("publish", home), input=json.dumps(command) + "\n", timeout=120)
        assert published.returncode == 0, published.stdout + published.stderr
        out, _ = trainer.communicate(timeout=150)
        assert trainer.returncode == 0, first + out[-3000:]
        assert "commands " + json.dumps(["evaluate_now"]) in out, out[-3000:]

        from areal_metrics.producers.contract.settings import Settings
        from areal_metrics.sinks.query import Target, connect, read_owner

        settings = Settings(clickhouse_url=f"chdb://{home / 'clickhouse'}", home=str(home))
        wait_for(lambda: read_owner(Target.parse(settings.clickhouse_url).path) is not None or sink.poll() is not None,
                 90, "the sink's store")
        assert sink.poll() is None, (logs / "sink.log").read_text()[-3000:]

        def rows(sql: str) -> list[tuple]:
            with connect(settings, wait_s=30) as store:
                return store.query(sql, {"r": run_id}).rows

        def smoothed() -> list[tuple]:
            return rows("SELECT step, reward, window, sliding_avg FROM rewards_smoothed FINAL "
                        "WHERE run_id = {r:String} ORDER BY step")

        try:
            wait_for(lambda: len(smoothed()) == len(rewards), 90, "every step's smoothed reward in the sink's table")
        except AssertionError:
            raise AssertionError((logs / "worker.log").read_text()[-2000:] + (logs / "sink.log").read_text()[-2000:])
        steps = rows("SELECT step, reward FROM steps FINAL WHERE run_id = {r:String} ORDER BY step")
        assert steps == [(i, r) for i, r in enumerate(rewards)]
        got = smoothed()
        assert [(s, r) for s, r, _, _ in got] == [(i, r) for i, r in enumerate(rewards)]
        for step, _, window, avg in got:  # the worker's sliding mean, checked against numpy's
            assert avg == pytest.approx(np.mean(rewards[max(0, step - window + 1):step + 1]))
        assert rows("SELECT command FROM commands FINAL WHERE run_id = {r:String}") == [("evaluate_now",)]
        assert rows("SELECT count() FROM deadletter") == [(0,)]  # nothing refused on the way
        # its grants let the worker read its changelog's limit, which bounds its state records
        assert "could not read the max.message.bytes" not in (logs / "worker.log").read_text()

        # `status` of this stack (what `up` records: the broker, the two services)
        assert secured.broker.process is not None
        monkeypatch.setenv("AREAL_HOME", str(home))
        write_info(StackInfo(kafka_bootstrap=secured.broker.bootstrap, kafka_port=secured.broker.port,
                             controller_port=secured.broker.controller_port, kafka_version=kafka_version(),
                             topic_prefix=secured.topics.prefix, clickhouse_url=settings.clickhouse_url,
                             home=str(home), pids={"kafka": secured.broker.process.pid, "worker": worker.pid,
                                                   "sink": sink.pid}))
        # side by side: `status`, and people looking on (`watch`) and rebuilding (`replay`) as their own principals
        running = {
            "status": _cli_started("status", "--json", env={**secured.env("admin", home),
                                                            "AREAL_KAFKA_SASL_PASSWORD": USERS["admin"]}),
            "watch": _cli_started("watch", "--run", run_id, "--duration", "3", env=secured.env("watch", home)),
            "replay": _cli_started("replay", env=secured.env("replay", home)),
        }
        done = {name: (proc.communicate(timeout=150), proc.returncode) for name, proc in running.items()}
        for name, ((stdout, stderr), code) in done.items():
            assert code == 0, f"{name}: {stdout[-2000:]}{stderr[-2000:]}"
            _no_secret(stdout + stderr, f"`{name}`")
        state = json.loads(done["status"][0][0])
        assert {n: p["alive"] for n, p in state["processes"].items()} == {"kafka": True, "worker": True, "sink": True}
        assert run_id in done["watch"][0][0]
        assert "steps\t12" in done["replay"][0][0].splitlines(), done["replay"]
        assert rows("SELECT step, reward FROM steps FINAL WHERE run_id = {r:String} ORDER BY step") == steps
        _no_secret(first + out, "the trainer's output")
        _no_secret(published.stdout + published.stderr, "`publish`")
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        stop_process(worker)
        stop_process(sink)
    for name in ("worker", "sink"):
        _no_secret((logs / f"{name}.log").read_text(), f"the {name}'s log")
    _no_secret(secured.broker.log_file.read_text(), "the broker's log")


def _refused(secured: Secured, config: dict[str, object], reason: str) -> None:
    """kafka-python cannot reach the broker with `config`, and the broker's log says it refused it for `reason`."""
    seen = secured.broker.log_file.stat().st_size
    with pytest.raises(KafkaError):
        KafkaAdminClient(**config, request_timeout_ms=3000, bootstrap_timeout_ms=3000).close()
    wait_for(lambda: reason in secured.broker.log_file.read_bytes()[seen:].decode("utf-8", "replace"), 10,
             f"the broker to log {reason!r}")


def test_a_client_without_credentials_or_with_a_wrong_password_is_refused(secured: Secured, tmp_path: Path) -> None:
    # the CLI, side by side with the checks below: one line, exit 1, the event kept in the journal
    home = tmp_path / "areal"
    command = json.dumps(CommandEvent(run_id="r1", command="stop").to_dict()) + "\n"
    env = {**secured.env("publish", home), "AREAL_KAFKA_SASL_PASSWORD": "not-the-password"}
    wrong_cli = _cli_started("publish", "-", "--timeout", "3", env=env, input=command)
    plain = {k: v for k, v in secured.env("publish", tmp_path / "plain").items() if not k.startswith("AREAL_KAFKA_S")}
    plain_cli = _cli_started("publish", "-", "--timeout", "3", env=plain, input=command)

    KafkaAdminClient(**secured.config("trainer"), request_timeout_ms=3000, bootstrap_timeout_ms=3000).close()  # the right one
    _refused(secured, {"bootstrap_servers": secured.broker.bootstrap}, "during SASL handshake")  # no SASL at all
    invalid = "due to invalid credentials with SASL mechanism SCRAM-SHA-256"
    _refused(secured, secured.config("trainer", "not-the-password"), invalid)
    _refused(secured, {**secured.config("trainer"), "sasl_plain_username": "nobody"}, invalid)  # no such user

    for proc in (wrong_cli, plain_cli):
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 1, stdout + stderr
        assert "journal" in stderr and len(stderr.strip().splitlines()) == 1, stderr
        assert "not-the-password" not in stdout + stderr


def test_the_trainer_cannot_write_commands_nor_read_alerts_unless_granted(secured: Secured, tmp_path: Path) -> None:
    t = secured.topics
    # nor through the CLI (started now, collected below): a compromised trainer's credentials cannot stop a run
    stop = json.dumps(CommandEvent(run_id="other-run", command="stop").to_dict()) + "\n"
    stop_cli = _cli_started("publish", "-", "--timeout", "3", env=secured.env("trainer", tmp_path / "t"), input=stop)
    producer = KafkaProducer(**secured.config("trainer"), acks="all", retries=0, max_block_ms=10_000)
    try:
        producer.send(t.steps, key=b"r1", value=StepEvent(run_id="r1", step=0, epoch=0).to_json()).get(30)  # what it may do
        with pytest.raises(TopicAuthorizationFailedError):
            producer.send(t.control, key=b"r1", value=CommandEvent(run_id="r1", command="stop").to_json()).get(30)
    finally:
        producer.close(timeout=5)

    # an alert, written by the worker's principal (the only writer of alerts)
    alert = AlertEvent(run_id="r1", kind="reward_collapse", severity="critical", message="secured test")
    worker = KafkaProducer(**secured.config("worker"), acks="all")
    worker.send(t.alerts, key=b"r1", value=alert.to_json()).get(30)
    worker.close(timeout=5)
    # the alerts principal follows them through the CLI, committing in its group (collected below)
    env = secured.env("alerts", tmp_path / "a")
    following = _cli_started("alerts", "--follow", "--group", ALERTS_GROUP, "--timeout", "8", env=env, input="")

    def read_alerts(user: str, wait_s: float = 30) -> list[AlertEvent]:
        consumer = KafkaConsumer(**secured.config(user), group_id=None, enable_auto_commit=False)
        try:
            tps = [TopicPartition(t.alerts, p) for p in range(3)]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            out: list[AlertEvent] = []
            deadline = time.monotonic() + wait_s
            while not out and time.monotonic() < deadline:
                for records in consumer.poll(timeout_ms=500).values():
                    out += [parse_event(r.value, expected=AlertEvent) for r in records]
            return out
        finally:
            consumer.close()

    def described(user: str) -> int:
        """The broker's error code when `user` asks for the alerts topic's metadata (0: allowed)."""
        admin = KafkaAdminClient(**secured.config(user))
        try:
            return admin.describe_topics([t.alerts])[0]["error_code"]
        finally:
            admin.close()

    # the trainer may write alerts (run.alert), and Kafka's WRITE implies DESCRIBE; its fetch is refused
    assert described("trainer") == 0
    with pytest.raises(TopicAuthorizationFailedError):
        read_alerts("trainer", wait_s=10)
    assert described("granted") == 0
    assert [a.alert_id for a in read_alerts("granted")] == [alert.alert_id]

    out, err = following.communicate(timeout=120)
    assert following.returncode == 0, out + err
    assert [json.loads(line)["alert_id"] for line in out.splitlines()] == [alert.alert_id]
    again = cli("alerts", "--group", ALERTS_GROUP, "--timeout", "3", env=env)  # the group resumes after it
    assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr
    _no_secret(out + err + again.stderr, "`alerts`")
    stdout, stderr = stop_cli.communicate(timeout=120)
    assert stop_cli.returncode == 1, stdout + stderr
