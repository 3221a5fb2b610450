"""A setting given to `init(...)` follows the rule its AREAL_* variable follows (issue 43, item 3), and a
bootstrap that is not `host:port[,host:port]` stops `init` with one line naming it (issue 44, item 3).

`init(exit_timeout_s=-1)` was accepted (overrides went through `dataclasses.replace`, which
skips the parser) while `AREAL_EXIT_TIMEOUT_S=-1` was refused; `localhost:notaport` read as an
outage. No broker is needed: each of these is refused before anything is sent.
"""

from __future__ import annotations

import re
import json
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from areal_metrics.producers.contract.errors import ConfigError, UserError
from areal_metrics.producers.contract.settings import Settings
from tests.support import ROOT


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("AREAL_KAFKA_BOOTSTRAP", "AREAL_EXIT_TIMEOUT_S", "AREAL_MODE", "AREAL_MAX_METRICS",
                 "AREAL_SYSTEM_METRICS_S", "AREAL_KAFKA_CLIENT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AREAL_HOME", str(tmp_path / "home"))


def rule(message: str) -> str:
    """The rule part of an error: what follows the name and the value."""
    return message.split(": ", 1)[1]


@pytest.mark.parametrize(("field", "value", "variable", "text"), [
    ("exit_timeout_s", -1, "AREAL_EXIT_TIMEOUT_S", "-1"),
    ("exit_timeout_s", float("nan"), "AREAL_EXIT_TIMEOUT_S", "nan"),
    ("max_metrics", 0, "AREAL_MAX_METRICS", "0"),
    ("max_metrics", 5000, "AREAL_MAX_METRICS", "5000"),
    ("max_metrics", 1.5, "AREAL_MAX_METRICS", "1.5"),
    ("kafka_client", "librdkafka", "AREAL_KAFKA_CLIENT", "librdkafka"),
    ("mode", "offline", "AREAL_MODE", "offline"),
    ("system_metrics_s", -0.5, "AREAL_SYSTEM_METRICS_S", "-0.5"),
    ("kafka_bootstrap", "localhost:notaport", "AREAL_KAFKA_BOOTSTRAP", "localhost:notaport"),
])
def test_an_override_is_refused_as_its_variable_is(field: str, value: object, variable: str, text: str) -> None:
    from areal_metrics.producers.client.settings import ClientSettings

    group = ClientSettings if field in {f.name for f in fields(ClientSettings)} else Settings
    with pytest.raises(ConfigError) as from_env:
        group.from_env({variable: text})
    with pytest.raises(ConfigError) as overridden:
        group.from_env({}).replace(**{field: value})
    assert rule(str(overridden.value)).startswith(rule(str(from_env.value))), (overridden.value, from_env.value)
    assert field in str(overridden.value) and variable in str(overridden.value)


def test_init_refuses_what_the_environment_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    from areal_metrics.producers.client.run import init

    with pytest.raises(ConfigError, match=re.escape("exit_timeout_s=-1 (AREAL_EXIT_TIMEOUT_S): expected a number >= 0")):
        init(run_id="r", exit_timeout_s=-1, git=False)
    monkeypatch.setenv("AREAL_EXIT_TIMEOUT_S", "-1")
    with pytest.raises(ConfigError, match=re.escape("AREAL_EXIT_TIMEOUT_S='-1': expected a number >= 0")):
        init(run_id="r", git=False)


def test_a_valid_override_is_taken_with_its_type() -> None:
    from areal_metrics.producers.client.settings import ClientSettings

    base = Settings.from_env({}, reader="client")
    s = base.replace(kafka_bootstrap="a:1, b:2", kafka_client="Kafka-Python")
    assert (s.kafka_bootstrap, s.kafka_client) == ("a:1,b:2", "kafka-python")
    client = ClientSettings.from_env({}).replace(exit_timeout_s=3, max_metrics="12")
    assert (client.exit_timeout_s, client.max_metrics) == (3.0, 12) and type(client.exit_timeout_s) is float
    assert s.run_id is None and base.replace(run_id=None).run_id is None
    with pytest.raises(ConfigError, match=r"exit_timeout_s=True \(AREAL_EXIT_TIMEOUT_S\): expected a number, got bool"):
        client.replace(exit_timeout_s=True)
    with pytest.raises(TypeError, match="unknown setting"):
        base.replace(no_such_setting=1)
    with pytest.raises(ConfigError) as secret:
        base.replace(kafka_sasl_password=12345678)
    assert "12345678" not in str(secret.value) and "kafka_sasl_password=***" in str(secret.value)


@pytest.mark.parametrize("value", ["localhost:notaport", "http://127.0.0.1:9092", "127.0.0.1", "a:1,,b:2",
                                   "host:0", "host:70000", "a b:1", "PLAINTEXT://kafka:9092"])
def test_a_malformed_bootstrap_is_named(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^AREAL_KAFKA_BOOTSTRAP=.*expected host:port\[,host:port\.\.\.\]"):
        Settings.from_env({"AREAL_KAFKA_BOOTSTRAP": value})


@pytest.mark.parametrize("value", ["127.0.0.1:9092", "localhost:1", "kafka-0.kafka.svc.cluster.local:9092",
                                   "a:1,b:2", " a:1 , b:2 ", "[::1]:9092", "my_host:65535"])
def test_a_wellformed_bootstrap_is_taken(value: str) -> None:
    assert Settings.from_env({"AREAL_KAFKA_BOOTSTRAP": value}).kafka_bootstrap == ",".join(p.strip() for p in value.split(","))


def test_init_with_a_malformed_bootstrap_stops_with_one_line_naming_the_variable(tmp_path: Path) -> None:
    """A user error (exit 2 in the CLI); from `init`, an exception of one line before anything starts."""
    code = ("import areal_metrics as am\n"
            "try:\n    am.init(run_id='r', git=False)\n"
            "except Exception as e:\n    print(type(e).__name__, '|', e)\n")
    env = {"AREAL_KAFKA_BOOTSTRAP": "http://127.0.0.1:9092", "AREAL_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    [line] = out.stdout.splitlines()
    assert line.startswith("ConfigError | AREAL_KAFKA_BOOTSTRAP='http://127.0.0.1:9092': expected host:port"), line
    assert not (tmp_path / "journal").exists()
    assert issubclass(ConfigError, UserError)


def test_how_a_setting_is_read_comes_from_its_annotation() -> None:
    """No `kind=` strings: int/float/bool/str from the annotation, a path or host:port list from its
    `Annotated` form, a choice from its `choices`; the declarations and the reader cannot disagree."""
    from areal_metrics.producers.client.settings import ClientSettings
    from areal_metrics.producers.contract.settings import _kind, settings_fields
    from areal_metrics.stack.settings import StackSettings
    from areal_metrics.streams.shell.settings import WorkerSettings

    assert all("kind" not in f.metadata for f in fields(Settings))
    kinds = {f.name: _kind(f) for g in (Settings, ClientSettings, WorkerSettings, StackSettings) for f in settings_fields(g)}
    assert (kinds["kafka_bootstrap"], kinds["kafka_ssl_cafile"], kinds["home"]) == ("hostports", "path", "path")
    assert (kinds["max_metrics"], kinds["exit_timeout_s"], kinds["clickhouse_replicated"]) == ("int", "float", "bool")
    assert (kinds["kafka_compression"], kinds["run_id"]) == ("choice", "str")
    # a process's own settings are read by the same rules (issue 43)
    assert (kinds["kafka_jars"], kinds["worker_max_runs"], kinds["streams_loglevel"]) == ("path", "int", "choice")
    base = Settings.from_env({}, reader="client")
    assert base.replace(kafka_ssl_cafile=Path("ca.pem")).kafka_ssl_cafile == "ca.pem"  # a path takes a PathLike
    with pytest.raises(ConfigError, match="expected a string"):
        base.replace(run_id=Path("r"))  # ... a plain string does not


def test_init_home_is_areal_home(tmp_path: Path) -> None:
    """`init(home=...)` was accepted and ignored: the journal, the attempt records and the stack recorded
    there all came from AREAL_HOME (or ~/.areal)."""
    chosen = tmp_path / "chosen"
    chosen.mkdir()
    (chosen / "stack.json").write_text(json.dumps({"kafka_bootstrap": "127.0.0.1:1", "topic_prefix": "homed."}))
    code = ("import areal_metrics as am\n"
            f"run = am.init(run_id='homed', home={str(chosen)!r}, git=False, exit_timeout_s=1)\n"
            "print(run.journal_directory, run.topics.prefix, run._settings.kafka_bootstrap)\n"
            "run.finish()\n")
    env = {"AREAL_HOME": str(tmp_path / "environment"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    journal, prefix, bootstrap = out.stdout.split()
    assert Path(journal).is_relative_to(chosen) and (prefix, bootstrap) == ("homed.", "127.0.0.1:1")
    assert (chosen / "runs" / "homed").is_dir() and not (tmp_path / "environment").exists()
