"""The Helm chart (deploy/helm/areal-metrics): linted, rendered, and every rendered manifest
validated against the Kubernetes schemas (kubernetes-validate, strict: unknown fields fail).

helm is built from its Go module by `make test` (the Makefile's helm stamp: `go install
helm.sh/helm/v4/cmd/helm@HELM_VERSION` into .venv/bin). Without helm or kubernetes-validate
these tests fail and say how to get them; they do not skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from areal_metrics.grafana.catalog import repo_root
from areal_metrics.grafana.provision import ENV, webhook_file

ROOT = repo_root()
CHART = ROOT / "deploy" / "helm" / "areal-metrics"
CI_VALUES = CHART / "ci" / "test-values.yaml"
# the oldest Kubernetes the chart declares (Chart.yaml kubeVersion) and the newest the validator knows
K8S_VERSIONS = ("1.25.0", "1.37.0")


def helm_binary() -> str:
    for candidate in (os.environ.get("AREAL_HELM"), str(Path(sys.prefix) / "bin" / "helm"), shutil.which("helm")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
    pytest.fail("helm is not installed: `make test` builds it from its Go module into .venv/bin "
                "(go install helm.sh/helm/v4/cmd/helm@v4.3.2), or set AREAL_HELM to a helm binary")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120, check=False)


def render(*sets: str, values: Path | None = CI_VALUES) -> list[dict[str, Any]]:
    args = ["template", "rel", str(CHART)]
    if values is not None:
        args += ["-f", str(values)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def _validator() -> Any:
    try:
        from kubernetes_validate import utils
    except ImportError:
        pytest.fail("kubernetes-validate is not installed: pip install -e '.[test]' (it is in the test extra)")
    return utils


def test_chart_lints_clean() -> None:
    out = helm("lint", "--strict", str(CHART), "-f", str(CI_VALUES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("sets", [(), ("secrets.alertWebhook=",), ("grafana.enabled=false",),
                                  ("secrets.existingSecret=mine", "secrets.existingSecretHasWebhook=true")])
def test_every_rendered_manifest_is_valid_kubernetes(sets: tuple[str, ...]) -> None:
    utils = _validator()
    docs = render(*sets)
    assert docs
    for version in K8S_VERSIONS:
        for doc in docs:
            try:
                utils.validate(doc, version, strict=True)
            except utils.ValidationError as exc:  # the manifest and the schema's complaint
                pytest.fail(f"{doc['kind']} {doc['metadata']['name']} on Kubernetes {version}: {exc.message} "
                            f"at {'/'.join(map(str, exc.path))}")


def test_the_validation_catches_a_broken_manifest() -> None:
    utils = _validator()
    (deployment, *_) = [d for d in render() if d["kind"] == "Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = 7
    with pytest.raises(utils.ValidationError):
        utils.validate(deployment, K8S_VERSIONS[-1], strict=True)
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "Always"
    deployment["spec"]["replica"] = 2  # a typo: strict validation refuses unknown fields
    with pytest.raises(utils.ValidationError):
        utils.validate(deployment, K8S_VERSIONS[-1], strict=True)


def test_required_values_and_the_values_schema_refuse_with_the_value_named() -> None:
    missing = helm("template", "rel", str(CHART))
    assert missing.returncode != 0 and "/kafka/bootstrap" in missing.stderr
    bad = helm("template", "rel", str(CHART), "-f", str(CI_VALUES), "--set", "kafka.bootstrap=http://kafka:9092")
    assert bad.returncode != 0 and "/kafka/bootstrap" in bad.stderr
    no_password = helm("template", "rel", str(CHART), "-f", str(CI_VALUES), "--set", "secrets.clickhousePassword=")
    assert no_password.returncode != 0 and "secrets.clickhousePassword" in no_password.stderr


def _by_name(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_worker_and_sink_run_our_modules_on_the_external_kafka_and_clickhouse() -> None:
    docs = _by_name(render())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    for component, service in (("worker", "streams"), ("sink", "sink")):
        container = _container(docs[f"Deployment/rel-areal-metrics-{component}"])
        assert container["command"] == compose[service]["command"]  # the same entry points as compose
        env = _env(container)
        assert env["AREAL_KAFKA_BOOTSTRAP"] == "kafka-0.kafka:9092,kafka-1.kafka:9092"
        assert container["readinessProbe"]["exec"]["command"][-2:] == ["/app/docker/healthcheck.py", service]
    sink = _container(docs["Deployment/rel-areal-metrics-sink"])
    names = [e["name"] for e in sink["env"]]
    # Kubernetes expands $(VAR) only from variables defined before it
    assert names.index("AREAL_CH_PASSWORD") < names.index("AREAL_CLICKHOUSE_URL")
    assert _env(sink)["AREAL_CLICKHOUSE_URL"] == "http://areal:$(AREAL_CH_PASSWORD)@clickhouse.db.svc:8123/areal"
    secret = docs["Secret/rel-areal-metrics-secrets"]["stringData"]
    assert secret == {"clickhouse-password": "writer-secret", "grafana-clickhouse-password": "reader-secret",
                      "alert-webhook": "https://hooks.example/areal"}


def test_grafana_is_our_image_with_the_datasource_environment_and_the_webhook() -> None:
    docs = _by_name(render())
    container = _container(docs["Deployment/rel-areal-metrics-grafana"])
    assert container["image"] == "areal-metrics-grafana:0.1.0"  # docker/grafana/Dockerfile: plugin baked in
    env = _env(container)
    assert "GF_INSTALL_PLUGINS" not in env  # nothing is fetched at start
    assert set(ENV.values()) <= set(env)  # what grafana/provisioning/datasources/clickhouse.yaml reads
    assert env["CLICKHOUSE_HOST"] == "clickhouse.db.svc" and env["CLICKHOUSE_PROTOCOL"] == "native"
    assert env["AREAL_GRAFANA_ALERT_WEBHOOK"]["secretKeyRef"]["key"] == "alert-webhook"
    webhook = docs["ConfigMap/rel-areal-metrics-grafana-webhook"]["data"]["webhook.yaml"]
    assert webhook.strip() == webhook_file().strip()  # the contact point and policy, from the Python definition
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == "/etc/grafana/provisioning/alerting/webhook.yaml"
    assert docs["Service/rel-areal-metrics-grafana"]["spec"]["ports"][0]["targetPort"] == "http"
    # without a webhook: no contact point, rules go to Grafana's default policy
    plain = _by_name(render("secrets.alertWebhook="))
    assert "ConfigMap/rel-areal-metrics-grafana-webhook" not in plain
    assert "volumeMounts" not in _container(plain["Deployment/rel-areal-metrics-grafana"])


def test_the_charts_webhook_file_is_the_generated_one() -> None:
    assert (CHART / "files" / "alerting-webhook.yaml").read_text() == webhook_file(), (
        "python -c 'from areal_metrics.grafana.provision import webhook_file; "
        "print(webhook_file(), end=\"\")' > deploy/helm/areal-metrics/files/alerting-webhook.yaml")
