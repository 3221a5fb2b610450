"""`areal-metrics grafana provision`'s own settings (AREAL_GRAFANA_*), by the contract's one
parser (docs/SETTINGS.md)."""

from __future__ import annotations

from dataclasses import dataclass

from areal_metrics.producers.contract.settings import SettingGroup, setting


@dataclass(frozen=True)
class GrafanaSettings(SettingGroup):
    """Grafana provisioning (`areal-metrics grafana provision`)"""

    grafana_clickhouse_url: str | None = setting("AREAL_GRAFANA_CLICKHOUSE_URL", None, "ClickHouse as Grafana "
                                                 "reaches it, for `grafana provision`", readers="stack")
    grafana_alert_webhook: str | None = setting("AREAL_GRAFANA_ALERT_WEBHOOK", None, "the URL Grafana's alert "
                                                "rules post to (a webhook contact point), for `grafana provision`",
                                                readers="stack", secret=True)
    grafana_stall_minutes: float = setting("AREAL_GRAFANA_STALL_MINUTES", 10.0, "Grafana's stall rule: a running "
                                           "run without a step for this many minutes fires it, for `grafana "
                                           "provision`", ge=1, le=1440, readers="stack")
