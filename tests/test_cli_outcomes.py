"""Honest CLI outcomes: exit 0 / 2 (bad input) / 1 (service unreachable, not delivered), one line, no traceback."""

import io
import json
import os
import time

import pytest

from areal_metrics.commands.alerts import wanted
from areal_metrics.stack.kafka_broker import free_port
from areal_metrics.progress import Progress, render, wait_for
from areal_metrics.producers.contract.events import AlertEvent
from tests.support import cli



def nowhere_env(tmp_path):
    """A broker address where nothing listens."""
    return {**os.environ, "AREAL_HOME": str(tmp_path), "AREAL_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}"}


def assert_one_line(result, code, *words):
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for word in words:
        assert word in result.stderr


def test_version_exits_0():
    from importlib.metadata import version

    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"areal-metrics {version('areal-metrics')}"


def test_every_verb_is_in_the_static_table():
    """No verb is loaded by string or skipped: each command module is imported and registered."""
    import argparse

    from areal_metrics.cli import VERBS, build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(VERBS)
    for verb, (module, _) in VERBS.items():
        assert sub.choices[verb].get_default("run") is module.run


def test_publish_to_an_unreachable_broker_exits_1_after_a_bounded_wait(tmp_path):
    event = {"type": "command", "run_id": "r1", "command": "evaluate_now"}
    started = time.monotonic()
    result = cli("publish", "--fill", "--timeout", "3", "-", env=nowhere_env(tmp_path), input=json.dumps(event) + "\n")
    elapsed = time.monotonic() - started
    assert_one_line(result, 1, "not delivered", "journal")
    assert "published" not in result.stdout
    assert elapsed < 60
    # the event is kept: the CLI's journal holds it for the next `publish`
    assert (tmp_path / "journal" / "cli" / "journal.log").read_bytes().count(b"evaluate_now") == 1


def test_publish_bad_timeout_is_bad_input(tmp_path):
    assert_one_line(cli("publish", "--timeout", "0", "-", env=nowhere_env(tmp_path), input=""), 2, "--timeout")


def test_alerts_without_a_broker_is_one_line_exit_1(tmp_path):
    result = cli("alerts", "--connect-timeout", "2", env=nowhere_env(tmp_path))
    assert_one_line(result, 1, "no Kafka broker")


@pytest.mark.parametrize("args", [["alerts", "--severity", "loud"], ["alerts", "--group", " "],
                                  ["alerts", "--kind", "bogus"], ["sync", "--run", "a b"], ["sync", "--timeout", "0"]])
def test_alerts_bad_flags_exit_2(args, tmp_path):
    assert_one_line(cli(*args, env=nowhere_env(tmp_path)), 2, "error")


def test_severity_filter_is_at_least():
    def alert(severity, run="r1", kind="stalled"):
        return AlertEvent(run_id=run, kind=kind, severity=severity, message="m")

    assert [s for s in ("info", "warning", "critical") if wanted(alert(s), [], [], "warning")] == ["warning", "critical"]
    assert wanted(alert("info"), [], [], None)
    assert not wanted(alert("critical", run="r2"), ["r1"], [], "info")
    assert not wanted(alert("critical", kind="eval_failed"), [], ["stalled"], None)


@pytest.mark.broker
def test_alerts_severity_and_a_durable_group_resume_where_they_stopped(stack_env, topics, kafka_bootstrap, tmp_path):
    from areal_metrics.producers.delivery.publisher import Publisher

    def publish(*alerts):
        publisher = Publisher(kafka_bootstrap, topics, tmp_path / "journal")
        for a in alerts:
            publisher.publish(a)
        assert publisher.flush(30)
        publisher.close()

    first = [AlertEvent(run_id="r1", kind="stalled", severity=s, message=s) for s in ("info", "warning", "critical")]
    publish(*first)
    severe = cli("alerts", "--severity", "warning", env=stack_env)
    assert severe.returncode == 0, severe.stderr
    assert [json.loads(line)["severity"] for line in severe.stdout.splitlines()] == ["warning", "critical"]

    group = f"g-{topics.prefix}"
    one = cli("alerts", "--group", group, env=stack_env)
    assert [json.loads(line)["event_id"] for line in one.stdout.splitlines()] == [a.event_id for a in first]
    later = AlertEvent(run_id="r1", kind="eval_failed", severity="critical", message="later")
    publish(later)
    two = cli("alerts", "--group", group, env=stack_env)
    assert two.returncode == 0, two.stderr
    assert [json.loads(line)["event_id"] for line in two.stdout.splitlines()] == [later.event_id]
    # without a group, nothing is remembered: the whole log again
    assert len(cli("alerts", env=stack_env).stdout.splitlines()) == 4


def test_progress_is_silent_off_a_terminal_and_draws_on_one():
    quiet = io.StringIO()
    with Progress("starting", stream=quiet) as p:
        p.advance()
    assert quiet.getvalue() == ""
    shown = io.StringIO()
    with Progress("replaying", total=4, stream=shown, force=True) as p:
        p.update(done=2)
        p.update(label="replaying steps")
    out = shown.getvalue()
    assert "replaying [" in out and "replaying steps" in out and out.endswith("\r")
    assert render("x", 3.2, 1, 4) == "x [######------------------] 1/4 3s"
    assert render("x", 3.2) == "x ... 3s"


def test_wait_for_is_bounded():
    started = time.monotonic()
    assert not wait_for(lambda: False, 0.5, "never")
    assert 0.4 < time.monotonic() - started < 5
    calls = []
    assert wait_for(lambda: calls.append(1) or len(calls) >= 3, 10, "soon", interval=0.01)


def test_every_alert_kind_the_worker_raises_is_one_alerts_accepts():
    """`alerts --kind` refuses unknown kinds: its list must hold every kind streams/ can raise."""
    import re
    from pathlib import Path

    from areal_metrics.producers.contract.events import ALERT_KINDS

    root = Path(__file__).resolve().parents[1] / "streams"
    source = "\n".join(p.read_text() for p in root.rglob("*.py"))
    raised = set(re.findall(r'kind="([a-z_]+)"', source)) | set(re.findall(r'_alert\("([a-z_]+)"', source))
    raised |= {f"run_{s}" for s in ("failed", "killed")} if 'kind=f"run_{status}"' in source else set()
    assert raised and raised <= set(ALERT_KINDS), raised - set(ALERT_KINDS)


def test_sql_against_an_unreachable_clickhouse_exits_1_and_a_bad_url_2(tmp_path):
    env = {**nowhere_env(tmp_path), "AREAL_CLICKHOUSE_URL": f"http://u:p@127.0.0.1:{free_port()}/areal"}
    assert_one_line(cli("sql", "SELECT 1", env=env), 1, "cannot reach ClickHouse")
    assert_one_line(cli("sql", "SELECT 1", env={**env, "AREAL_CLICKHOUSE_URL": "ftp://x"}), 2, "AREAL_CLICKHOUSE_URL")


def test_the_store_verbs_exit_1_when_a_service_does_not_answer_and_2_when_it_refuses(tmp_path):
    """One StoreError of each kind, no verb re-mapping it: unreachable 1, a bad URL or query 2 (README)."""
    env = {**nowhere_env(tmp_path), "AREAL_CLICKHOUSE_URL": f"http://u:p@127.0.0.1:{free_port()}/areal"}
    assert_one_line(cli("compare", "a", "b", env=env), 1, "cannot reach ClickHouse")
    assert_one_line(cli("compare", "a", "b", env={**env, "AREAL_CLICKHOUSE_URL": "ftp://x"}), 2, "AREAL_CLICKHOUSE_URL")
    assert_one_line(cli("replay", env=env), 1, "replay failed")  # the store does not answer
    embedded = {**env, "AREAL_CLICKHOUSE_URL": f"chdb://{tmp_path / 'ch'}"}
    assert_one_line(cli("replay", env=embedded), 1, "no broker answers")
    assert_one_line(cli("sql", "SELEC 1", env=embedded), 2, "DB::Exception")


def test_help_says_what_the_verbs_do_for_a_user():
    result = cli("--help")
    assert result.returncode == 0
    assert "module" not in result.stdout and "areal_metrics.commands" not in result.stdout
    for words in ("first steps:", "areal-metrics up", "exit status:", "sync", "--webhook"):
        assert words in result.stdout, words


def test_every_verbs_help_prints_without_a_traceback():
    """argparse formats each option's help with %: a bare "95 % t" in one broke `report --help`."""
    from areal_metrics.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and isinstance(a.choices, dict))
    assert len(subparsers.choices) >= 10
    for verb, sub in subparsers.choices.items():
        assert sub.format_help().strip(), verb  # raises on a bad format character
