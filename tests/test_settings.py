"""Every AREAL_* variable is a declared setting (producers/contract/settings.py).

Every AREAL_* name in the source is a declared setting, in the contract's `Settings` when several
processes read it, else in the settings class beside the one process that reads it (issue 43);
no module but settings.py reads one from the environment; docs/SETTINGS.md's tables are the ones
the declarations make; and every variable, whichever class declares it, is parsed and
range-checked by one rule, with an error that names it.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from areal_metrics.all_settings import GROUPS, table
from areal_metrics.all_settings import VARIABLES as INSTALLED_VARIABLES
from areal_metrics.producers.client.settings import ClientSettings
from areal_metrics.producers.contract.errors import ConfigError
from areal_metrics.producers.contract.settings import (SettingGroup, Settings, is_set, markdown_table, read_setting,
                                                     settings_fields)
from areal_metrics.sinks.settings import SinkSettings
from areal_metrics.stack.settings import StackSettings
from areal_metrics.streams.shell.settings import WorkerSettings
from benchmarks.settings import BenchSettings

# the benchmarks' own settings too (not installed, so not in areal_metrics.all_settings)
VARIABLES = {**INSTALLED_VARIABLES, **{f.metadata["env"]: (BenchSettings, f.name) for f in settings_fields(BenchSettings)}}

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("producers", "streams", "sinks", "areal_train", "grafana", "areal_metrics", "benchmarks")
SETTINGS_FILE = ROOT / "producers" / "contract" / "settings.py"
# a read of an AREAL_* variable: os.environ.get("AREAL_X"), os.getenv("AREAL_X"), env.get("AREAL_X"),
# os.environ["AREAL_X"] not followed by an assignment
READ = re.compile(r"""(?:\.get|getenv)\(\s*["'](AREAL_\w+)|environ\[\s*["'](AREAL_\w+)["']\s*\](?!\s*=[^=])""")


def python_files() -> list[Path]:
    return [p for top in SOURCES for p in sorted((ROOT / top).rglob("*.py"))]


def test_every_areal_variable_in_the_source_is_a_declared_setting() -> None:
    secrets = {f.metadata["env"] + "_FILE" for g in GROUPS for f in fields(g) if f.metadata["secret"]}
    assert not INSTALLED_VARIABLES.keys() & {f.metadata["env"] for f in settings_fields(BenchSettings)}
    named = {(m, p.relative_to(ROOT)) for p in python_files() for m in re.findall(r"\bAREAL_[A-Z0-9_]*[A-Z0-9]\b", p.read_text())}
    unknown = sorted(f"{name} in {path}" for name, path in named if name not in VARIABLES and name not in secrets)
    assert unknown == []


def test_no_module_but_settings_reads_an_areal_variable_from_the_environment() -> None:
    reads = [f"{p.relative_to(ROOT)}: {next(filter(None, m))}" for p in python_files() if p != SETTINGS_FILE
             for m in READ.findall(p.read_text())]
    assert reads == []


def test_the_read_pattern_sees_reads_and_not_writes() -> None:
    text = ('os.environ.get("AREAL_A")\nos.getenv("AREAL_B")\nenv.get("AREAL_C", "")\nx = os.environ["AREAL_D"]\n'
            'os.environ["AREAL_E"] = "1"\nenv["AREAL_F"] = x\nos.environ.setdefault("AREAL_G", "1")\n')
    assert sorted(next(filter(None, m)) for m in READ.findall(text)) == ["AREAL_A", "AREAL_B", "AREAL_C", "AREAL_D"]


def test_docs_settings_table_is_the_declared_one() -> None:
    page = (ROOT / "docs" / "SETTINGS.md").read_text()
    assert table() in page, "run `python -m areal_metrics.all_settings` into docs/SETTINGS.md's tables"
    assert markdown_table((BenchSettings,)) in page, "the benchmarks' table: markdown_table((BenchSettings,))"
    assert all(f"| `{variable}` |" in page for variable in VARIABLES)


def test_a_setting_one_process_reads_lives_beside_it_not_in_the_contract() -> None:
    """Issue 43: the worker's, the sink's, the stack's, Grafana's and the trainer's own settings are
    each in a class beside that process; the contract keeps those several read (or the client's)."""
    own = {f.metadata["env"]: group for group in (*GROUPS[1:], BenchSettings) for f in settings_fields(group)}
    assert {"AREAL_WORKER_RUN_IDLE_S", "AREAL_WORKER_ENDED_RUN_IDLE_S", "AREAL_WORKER_MAX_RUNS",
            "AREAL_STREAMS_LINGER_MS"} <= {v for v, g in own.items() if g is WorkerSettings}
    assert {"AREAL_SINK_MAX_ROWS", "AREAL_HTTP_QUERY_TIMEOUT_S", "AREAL_LOG_LEVEL"} <= {
        v for v, g in own.items() if g is SinkSettings}
    assert {"AREAL_RESTART_MAX", "AREAL_RESTART_BACKOFF_S", "AREAL_KAFKA_HEAP", "AREAL_KAFKA_JARS"} <= {
        v for v, g in own.items() if g is StackSettings}
    assert {"AREAL_EXIT_TIMEOUT_S", "AREAL_MODE", "AREAL_MAX_METRICS", "AREAL_SYSTEM_METRICS_S"} <= {
        v for v, g in own.items() if g is ClientSettings}
    assert "AREAL_BENCH_PROFILE_DIR" in own
    assert not own.keys() & {f.metadata["env"] for f in settings_fields(Settings)}
    # what stays in the contract is read by several processes
    assert [f.name for f in settings_fields(Settings) if len(f.metadata["readers"]) < 2] == []
    for group in (*GROUPS[1:], BenchSettings):
        assert issubclass(group, SettingGroup)  # read by the contract's one parser
        readers = {r for f in settings_fields(group) for r in f.metadata["readers"]}
        assert len(readers) == 1, (group, readers)  # one process reads them


@pytest.mark.parametrize(("env", "value", "words"), [
    ("AREAL_SINK_MAX_ROWS", "0", "AREAL_SINK_MAX_ROWS='0': expected a number >= 1"),
    ("AREAL_SINK_HTTP_PORT", "70000", "AREAL_SINK_HTTP_PORT='70000': expected a number >= 0 and <= 65535"),
    ("AREAL_STREAMS_COMMIT_INTERVAL", "nan", "expected a finite number"),
    ("AREAL_EXIT_TIMEOUT_S", "soon", "AREAL_EXIT_TIMEOUT_S='soon': expected a number"),
    ("AREAL_KAFKA_REPLICATION_FACTOR", "1.5", "expected an integer"),
    ("AREAL_SINK_STOP_MERGES", "maybe", "expected 1/0, true/false"),
    ("AREAL_KAFKA_CLIENT", "librdkafka", "expected one of auto, confluent-kafka, kafka-python"),
    ("AREAL_STREAMS_LOGLEVEL", "loud", "expected one of debug, info"),
])
def test_a_variable_that_cannot_be_used_is_named_in_one_error(env: str, value: str, words: str) -> None:
    group, name = VARIABLES[env]  # the class that declares it: the contract's or a process's own
    with pytest.raises(ConfigError, match=re.escape(words)):
        group.from_env({env: value})
    with pytest.raises(ConfigError, match=re.escape(words.split(": ", 1)[1] if ": " in words else words)):
        group.from_env({}).replace(**{name: value})  # an override in Python follows the same rule


def test_values_defaults_and_the_derived_defaults() -> None:
    env = {"AREAL_HOME": "/tmp/h", "AREAL_SINK_MAX_ROWS": " 200 ", "AREAL_SINK_STOP_MERGES": "yes",
           "AREAL_CLICKHOUSE_CLUSTER": "c1", "AREAL_STREAMS_LOGLEVEL": "INFO"}
    s, sink, worker = Settings.from_env(env), SinkSettings.from_env(env), WorkerSettings.from_env(env)
    assert (sink.sink_max_rows, sink.sink_stop_merges, worker.streams_loglevel) == (200, True, "info")
    assert s.clickhouse_url == "chdb:///tmp/h/clickhouse" and s.clickhouse_replicated is True
    assert s.kafka_bootstrap == "127.0.0.1:9092" and sink.sink_max_wait_ms == 500 and s.clickhouse_steps_ttl_days is None
    assert Settings.from_env({"AREAL_CLICKHOUSE_STEPS_TTL_DAYS": "0"}).clickhouse_steps_ttl_days is None
    assert read_setting("max_json_depth", {}) == 64 and read_setting("max_json_depth", {"AREAL_MAX_JSON_DEPTH": "9"}) == 9
    assert SinkSettings.from_env({}) == SinkSettings() and WorkerSettings.from_env({}).worker_max_runs == 10_000
    assert WorkerSettings.chosen({"AREAL_WORKER_MAX_RUNS": "5", "AREAL_STREAMS_LINGER_MS": " "}) == {"worker_max_runs"}
    assert StackSettings.from_env({"XDG_CACHE_HOME": "/c"}).kafka_jars_dir("4") == Path("/c/areal-metrics/kafka-4")
    assert StackSettings.from_env({"AREAL_KAFKA_JARS": "/j", "XDG_CACHE_HOME": "/c"}).kafka_jars_dir("4") == Path("/j")
    assert is_set("kafka_bootstrap", {"AREAL_KAFKA_BOOTSTRAP": "h:1"}) and not is_set("kafka_bootstrap", {})


def test_a_secret_comes_from_its_file_and_is_never_printed(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("s3cret\n")
    s = Settings.from_env({"AREAL_KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "pw")})
    assert s.kafka_sasl_password == "s3cret"
    assert "s3cret" not in repr(s) and s.public()["kafka_sasl_password"] == "***"
    with pytest.raises(ConfigError, match="AREAL_KAFKA_SASL_PASSWORD_FILE"):
        Settings.from_env({"AREAL_KAFKA_SASL_PASSWORD_FILE": str(tmp_path / "absent")})


def test_a_reader_reads_only_its_own_variables() -> None:
    """A trainer is never stopped by a variable meant for the sink."""
    env = {"AREAL_CLICKHOUSE_STEPS_TTL_DAYS": "lots", "AREAL_SINK_MAX_ROWS": "lots", "AREAL_EXIT_TIMEOUT_S": "3"}
    assert ClientSettings.from_env(env).exit_timeout_s == 3.0
    with pytest.raises(ConfigError, match="AREAL_CLICKHOUSE_STEPS_TTL_DAYS"):
        Settings.from_env(env, reader="sink")
    with pytest.raises(ConfigError, match="AREAL_SINK_MAX_ROWS"):
        SinkSettings.from_env(env)  # the sink's own, read by the sink alone
