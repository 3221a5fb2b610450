"""What a review of every verb found to end in a traceback, the wrong exit status or a long wait,
each run as a user runs it: one line on stderr, exit 2 for bad input and 1 for a service away, no
traceback, within seconds. No services: a closed port for Kafka and for ClickHouse."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_metrics.stack.kafka_broker import free_port
from tests import support
from tests.support import cli
from tests.test_cli_outcomes import assert_one_line


def env_of(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AREAL_")}
    return {**env, "AREAL_HOME": str(home), "AREAL_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}", **extra}


@pytest.fixture()
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with support.silent_server() as port:
        yield port


@pytest.mark.parametrize("args", [["sql", "SELECT 1"], ["report"], ["compare", "a", "b"]])
def test_a_malformed_clickhouse_url_is_bad_input(tmp_path: Path, args: list[str]) -> None:
    result = cli(*args, env=env_of(tmp_path, AREAL_CLICKHOUSE_URL="http://[::1/areal"), timeout=60)
    assert_one_line(result, 2, "AREAL_CLICKHOUSE_URL")


@pytest.mark.parametrize("args", [
    ["grafana", "provision", "--url", "http://[::1"],
    ["grafana", "provision", "--url", "http://127.0.0.1:1", "--webhook", "http://[::1"],
    ["alerts", "--webhook", "http://[::1"],
    ["grafana", "provision", "--url", "http://127.0.0.1:1", "--timeout", "nan"],
    ["grafana", "provision", "--url", "http://127.0.0.1:1", "--timeout", "-1"],
    ["alerts", "--timeout", "nan"],
    ["alerts", "--connect-timeout", "inf"],
    ["watch", "--duration", "nan"],
    ["watch", "--every", "0"],
    ["publish", "--timeout", "nan", "-"],
    ["sync", "--timeout", "inf"],
    ["train", "--run-id", "r1", "--no-publish", "--timeout", "nan"],
    ["grafana", "provision", "--files", ""],
])
def test_a_bad_flag_value_is_one_line_exit_2(tmp_path: Path, args: list[str]) -> None:
    result = cli(*args, env=env_of(tmp_path, AREAL_CLICKHOUSE_URL="http://127.0.0.1:1/areal"), input="", timeout=60)
    assert_one_line(result, 2)
    assert not any(tmp_path.iterdir()) or args[0] != "grafana", "nothing written"


def test_provision_files_where_a_folder_cannot_be_is_bad_input(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    result = cli("grafana", "provision", "--files", str(a_file),
                 env=env_of(tmp_path, AREAL_CLICKHOUSE_URL="http://127.0.0.1:1/areal"), timeout=60)
    assert_one_line(result, 2, "--files", "cannot write there")


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_config_nested_too_deeply_is_bad_input(tmp_path: Path, suffix: str) -> None:
    config = tmp_path / f"deep{suffix}"
    config.write_text("[" * 100_000 if suffix == ".json" else "a = " + "[" * 100_000)
    result = cli("train", "--run-id", "r1", "--no-publish", "--config", str(config), env=env_of(tmp_path), timeout=60)
    assert_one_line(result, 2, "nested too deeply")


def test_a_security_protocol_kafka_does_not_know_is_bad_input_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    result = cli("alerts", env=env_of(tmp_path, AREAL_KAFKA_SECURITY_PROTOCOL="bogus"), timeout=60)
    assert_one_line(result, 2, "AREAL_KAFKA_SECURITY_PROTOCOL")
    assert time.monotonic() - started < 10


def test_the_security_protocol_is_read_in_any_case() -> None:
    from areal_metrics.producers.contract.settings import Settings

    settings = Settings.from_env({"AREAL_KAFKA_SECURITY_PROTOCOL": "ssl"})
    assert settings.kafka_python_config()["security_protocol"] == "SSL"  # kafka-python compares upper case


@pytest.mark.parametrize("recorded", [{"pids": {"kafka": "abc"}}, {"pids": ["a"]}, {"clickhouse_url": 5},
                                      {"kafka_bootstrap": 5}, {"kafka_port": "9092"}])
@pytest.mark.parametrize("verb", [["status"], ["status", "--json"], ["down"]])
def test_a_stack_record_of_the_wrong_shape_is_read_as_none(tmp_path: Path, recorded: dict, verb: list[str]) -> None:
    good = {"kafka_bootstrap": "127.0.0.1:1", "kafka_port": 1, "controller_port": 2, "kafka_version": "4",
            "topic_prefix": "areal.", "clickhouse_url": f"chdb://{tmp_path}/ch", "home": str(tmp_path),
            "pids": {}, "started_at": 0.0}
    (tmp_path / "stack.json").write_text(json.dumps({**good, **recorded}))
    env = env_of(tmp_path)
    del env["AREAL_KAFKA_BOOTSTRAP"]  # what `up` recorded is read
    result = cli(*verb, env=env, timeout=60)
    assert "Traceback" not in result.stderr and result.returncode in (0, 1), result.stderr


def test_a_home_that_is_a_file_is_bad_input_at_once(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.write_text("x")
    started = time.monotonic()
    assert_one_line(cli("publish", "-", env=env_of(home), input="{}\n", timeout=60), 2, "AREAL_HOME")
    for args in (["sql", "SELECT 1"], ["report"]):
        assert_one_line(cli(*args, env=env_of(home), timeout=60), 2, "is a file, not a folder")
    assert time.monotonic() - started < 30, "no wait for a store that cannot be"


def test_a_reader_on_a_fresh_home_says_there_is_no_store_and_makes_none(tmp_path: Path) -> None:
    result = cli("sql", "SELECT 1", env=env_of(tmp_path), timeout=60)
    assert_one_line(result, 1, "no ClickHouse store", "areal-metrics up")
    assert not (tmp_path / "clickhouse").exists()


def test_sync_skips_a_journal_it_cannot_open_and_says_so(tmp_path: Path) -> None:
    (tmp_path / "journal" / "x" / "journal.log").mkdir(parents=True)  # a folder where the file goes
    locked = tmp_path / "journal" / "y"
    locked.mkdir()
    (locked / "journal.log").write_text("")
    (locked / "journal.lock").mkdir()  # the lock file cannot be opened
    result = cli("sync", "--timeout", "2", env=env_of(tmp_path), timeout=60)
    assert_one_line(result, 2, "could not be opened", str(locked))


def test_a_clickhouse_server_that_does_not_answer_is_away_within_seconds(tmp_path: Path, silent_server: int) -> None:
    started = time.monotonic()
    result = cli("sql", "SELECT 1",
                 env=env_of(tmp_path, AREAL_CLICKHOUSE_URL=f"http://default:@127.0.0.1:{silent_server}/areal"),
                 timeout=120)
    assert_one_line(result, 1, "/ping")
    assert time.monotonic() - started < 40, "the driver's own read timeout is 300 s"


def test_a_grafana_that_does_not_answer_is_away_not_a_refusal(tmp_path: Path, silent_server: int) -> None:
    result = cli("grafana", "provision", "--url", f"http://127.0.0.1:{silent_server}", "--timeout", "2",
                 env=env_of(tmp_path, AREAL_CLICKHOUSE_URL="http://127.0.0.1:1/areal"), timeout=120)
    assert_one_line(result, 1, "Grafana")


def test_watch_without_a_broker_gives_up_within_seconds(tmp_path: Path) -> None:
    started = time.monotonic()
    assert_one_line(cli("watch", "--duration", "1", env=env_of(tmp_path), timeout=60), 1, "Kafka")
    assert time.monotonic() - started < 20, "kafka-python's own bootstrap wait is 30 s"


def test_output_to_a_full_disk_is_one_line(tmp_path: Path) -> None:
    from tests.support import CLI

    with open("/dev/full", "w") as full_disk:
        full = subprocess.run([*CLI, "status"], env=env_of(tmp_path), stdout=full_disk, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    assert "Traceback" not in full.stderr and full.returncode == 1, full.stderr
    assert len(full.stderr.strip().splitlines()) == 1


def test_sync_without_a_broker_says_so_at_once_not_after_a_wait_per_journal(tmp_path: Path) -> None:
    for rank in range(3):  # three ranks' journals on one host, each holding an event
        folder = tmp_path / "journal" / "r1" / f"rank-{rank}"
        folder.mkdir(parents=True)
        (folder / "journal.log").write_bytes(b'areal.runs\tr1\t{"type":"run"}\n')
    started = time.monotonic()
    result = cli("sync", "--timeout", "30", env=env_of(tmp_path), timeout=200)
    assert_one_line(result, 1, "no broker accepts a connection", "3 journal(s)")
    assert time.monotonic() - started < 20, "each journal waited --timeout (90 s in all)"
    assert all((tmp_path / "journal" / "r1" / f"rank-{r}" / "journal.log").stat().st_size > 0 for r in range(3))
