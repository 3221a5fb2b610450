"""Every settings class, for docs/SETTINGS.md (`python -m areal_metrics.all_settings` prints its
tables) and the checks that every AREAL_* name is declared once (tests/test_settings.py).

The contract's `Settings` holds what several processes read; each process's own settings live
beside it (a `SettingGroup`) and are read by the same parser. This module sits on top of the
rooms, where it may import them all; it reads no environment.
"""

from __future__ import annotations

from dataclasses import fields

from areal_metrics.areal_train.settings import TrainerSettings
from areal_metrics.grafana.settings import GrafanaSettings
from areal_metrics.producers.client.settings import ClientSettings
from areal_metrics.producers.contract.settings import Settings, markdown_table, settings_fields
from areal_metrics.sinks.settings import SinkSettings
from areal_metrics.stack.settings import StackSettings
from areal_metrics.streams.shell.settings import WorkerSettings

GROUPS: tuple[type, ...] = (Settings, ClientSettings, WorkerSettings, SinkSettings, StackSettings, GrafanaSettings, TrainerSettings)
# variable -> (settings class, field name), for every variable of every class
VARIABLES = {f.metadata["env"]: (group, f.name) for group in GROUPS for f in settings_fields(group)}
assert len(VARIABLES) == sum(len(fields(g)) for g in GROUPS), "a variable is declared twice"


def table() -> str:
    """docs/SETTINGS.md's tables: one per settings class."""
    return markdown_table(GROUPS)


if __name__ == "__main__":
    print(table(), end="")
