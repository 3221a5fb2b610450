"""compose.yaml agrees with the provisioning, the dashboards and our services' settings.

`docker compose config` needs Docker; this reads the file itself and checks what
the stack depends on: health checks, start order, mounts at the paths the
provisioning expects, the datasource's environment, the pinned plugin, and
that the trainer and stream-worker configs it mounts are valid.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from areal_metrics.grafana.catalog import repo_root
from areal_metrics.grafana.clickhouse import PLUGIN_ID, PLUGIN_VERSION
from areal_metrics.grafana.provision import CONTAINER_DASHBOARDS, ENV

ROOT = repo_root()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")  # PyYAML: a test dependency
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_every_long_running_service_has_a_health_check(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {"kafka", "clickhouse", "grafana", "streams", "sink", "trainer-mt4", "trainer-mt2", "topics"} <= set(services)
    for name in ("kafka", "clickhouse", "grafana", "streams", "sink"):
        assert services[name].get("healthcheck", {}).get("test"), name


def test_start_order_waits_for_health(compose: dict[str, Any]) -> None:
    s = compose["services"]
    assert s["topics"]["depends_on"]["kafka"]["condition"] == "service_healthy"
    assert s["sink"]["depends_on"]["clickhouse"]["condition"] == "service_healthy"
    for trainer in ("trainer-mt4", "trainer-mt2"):
        assert s[trainer]["depends_on"] == {"streams": {"condition": "service_healthy"},
                                            "sink": {"condition": "service_healthy"}}


def test_grafana_gets_the_plugin_provisioning_and_datasource_environment(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    # the plugin is baked into our image at its pinned version: nothing is installed at start (air-gapped)
    assert grafana["build"]["dockerfile"] == "docker/grafana/Dockerfile"
    assert "GF_INSTALL_PLUGINS" not in grafana["environment"]
    dockerfile = (ROOT / "docker" / "grafana" / "Dockerfile").read_text()
    assert "ARG GRAFANA_VERSION=11." in dockerfile and f"ARG CLICKHOUSE_PLUGIN_VERSION={PLUGIN_VERSION}" in dockerfile
    assert f"plugins install {PLUGIN_ID} " in dockerfile
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith("./")}
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    assert mounts[CONTAINER_DASHBOARDS] == "./grafana/dashboards"
    assert set(ENV.values()) <= set(grafana["environment"])
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "grafana" / "dashboards" / Path(home).name).exists()


def test_our_services_share_one_dockerfile_and_the_settings(compose: dict[str, Any]) -> None:
    s = compose["services"]
    for name in ("streams", "sink", "trainer-mt4", "trainer-mt2"):
        assert s[name]["build"]["dockerfile"] == "docker/Dockerfile"
        env = s[name]["environment"]
        assert env["AREAL_KAFKA_BOOTSTRAP"] == "kafka:9092"
        assert env["AREAL_CLICKHOUSE_URL"].startswith("http://") and "@clickhouse:8123" in env["AREAL_CLICKHOUSE_URL"]
    assert s["streams"]["command"] == ["python", "-m", "areal_metrics.streams"]
    assert s["sink"]["command"] == ["python", "-m", "areal_metrics.sinks"]
    assert (ROOT / "docker" / "Dockerfile").exists() and (ROOT / "docker" / "healthcheck.py").exists()


def test_the_worker_and_the_sink_are_restarted_and_keep_their_state_dir_on_a_volume(compose: dict[str, Any]) -> None:
    """A crash never loops there either: the restart is Docker's, the poison skip is the service's,
    which needs its in-flight record (producers/runtime/poison.py) to outlive the container."""
    s = compose["services"]
    for name in ("streams", "sink"):
        assert s[name]["restart"] in ("unless-stopped", "always", "on-failure")
        home = s[name]["environment"]["AREAL_HOME"]
        assert any(v.split(":")[1] == home and v.split(":")[0] in compose["volumes"] for v in s[name]["volumes"])


def test_mounted_configs_are_valid(compose: dict[str, Any]) -> None:
    from areal_metrics.areal_train.config import load
    from areal_metrics.streams.core.config import StreamsConfig

    strategies = []
    for trainer in ("trainer-mt4", "trainer-mt2"):
        command = compose["services"][trainer]["command"]
        config = command[command.index("--config") + 1].replace("/app/", "")
        strategies.append(load(ROOT / config).strategy)
    assert strategies == ["mt4-grpo", "mt2-grpo"]
    streams_config = compose["services"]["streams"]["environment"]["AREAL_STREAMS_CONFIG"].replace("/app/", "")
    assert StreamsConfig.load(ROOT / streams_config).for_run("compose-mt2").lr_eval_threshold is not None


@pytest.mark.broker
def test_health_check_sees_a_consumer_group_with_members(kafka_bootstrap: str, topics: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """docker/healthcheck.py against the real broker: healthy only while the group has a member."""
    import importlib.util
    import time

    from kafka import KafkaConsumer

    spec = importlib.util.spec_from_file_location("areal_healthcheck", ROOT / "docker" / "healthcheck.py")
    assert spec and spec.loader
    health = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(health)
    monkeypatch.setenv("AREAL_KAFKA_BOOTSTRAP", kafka_bootstrap)
    group = f"{topics.prefix}health"
    assert health.group_has_members(group) is False
    consumer = KafkaConsumer(topics.steps, bootstrap_servers=kafka_bootstrap, group_id=group)
    try:
        deadline = time.monotonic() + 30
        while not health.group_has_members(group):
            consumer.poll(timeout_ms=200)
            assert time.monotonic() < deadline, "the consumer never joined its group"
    finally:
        consumer.close()
    assert health.group_has_members(group) is False  # left the group on close


def test_grafana_reads_clickhouse_as_a_read_only_user(compose: dict[str, Any]) -> None:
    grafana_env = compose["services"]["grafana"]["environment"]
    clickhouse = compose["services"]["clickhouse"]
    writer = clickhouse["environment"]["CLICKHOUSE_USER"]
    assert grafana_env["CLICKHOUSE_USER"] == clickhouse["environment"]["GRAFANA_CH_USER"] != writer
    assert "./docker/clickhouse-init:/docker-entrypoint-initdb.d:ro" in clickhouse["volumes"]
    init = (ROOT / "docker/clickhouse-init/10-readonly-user.sh").read_text()
    assert "SETTINGS readonly = 2" in init
    grants = [line for line in init.splitlines() if line.startswith("GRANT")]
    assert grants == ["GRANT SELECT ON ${CLICKHOUSE_DB}.* TO ${GRAFANA_CH_USER};"]


def test_clickhouse_listens_on_this_host_only_with_passwords_from_the_environment(compose: dict[str, Any]) -> None:
    clickhouse = compose["services"]["clickhouse"]
    assert clickhouse["ports"] and all(p.startswith("127.0.0.1:") for p in clickhouse["ports"])
    text = (ROOT / "compose.yaml").read_text()
    # `${VAR:?message}`: compose refuses to start without the variable; no default password anywhere
    assert clickhouse["environment"]["CLICKHOUSE_PASSWORD"].startswith("${AREAL_CH_PASSWORD:?")
    assert clickhouse["environment"]["GRAFANA_CH_PASSWORD"].startswith("${GRAFANA_CH_PASSWORD:?")
    assert compose["services"]["grafana"]["environment"]["CLICKHOUSE_PASSWORD"].startswith("${GRAFANA_CH_PASSWORD:?")
    for name in ("streams", "sink"):
        assert ":${AREAL_CH_PASSWORD:?" in compose["services"][name]["environment"]["AREAL_CLICKHOUSE_URL"]
    assert "CH_PASSWORD:-" not in text and ":areal@" not in text
