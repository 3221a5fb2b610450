"""The client's own settings (AREAL_EXIT_TIMEOUT_S, AREAL_MODE, AREAL_MAX_METRICS, AREAL_SYSTEM_METRICS_S): read by
`areal_metrics.init` alone, in the trainer's processes, by the contract's one parser
(docs/SETTINGS.md). `init(**settings)` takes each by its field name, as it takes the shared
`Settings`' fields."""

from __future__ import annotations

from dataclasses import dataclass

from areal_metrics.producers.contract.field_rules import METRICS_MAX
from areal_metrics.producers.contract.settings import SettingGroup, setting


@dataclass(frozen=True)
class ClientSettings(SettingGroup):
    """The client (`areal_metrics.init`)"""

    exit_timeout_s: float = setting("AREAL_EXIT_TIMEOUT_S", 10.0, "how long exit and finish() wait for the "
                                    "broker's acknowledgement before leaving the rest in the journal",
                                    ge=0, readers="client")
    mode: str = setting("AREAL_MODE", "online", "online: send to Kafka (a journal on disk while it is away); "
                        "disabled: init() gives a run whose calls do nothing (no thread, no journal, nothing sent)",
                        choices=("online", "disabled"), readers="client")
    max_metrics: int = setting("AREAL_MAX_METRICS", METRICS_MAX, "names one step's `metrics` keeps (the first "
                               "logged); past it log() warns once and counts the rest in stats().skipped",
                               ge=1, le=METRICS_MAX, readers="client")
    system_metrics_s: float = setting("AREAL_SYSTEM_METRICS_S", 0.0, "sample CPU, memory and (with pynvml) GPU "
                                      "utilisation and memory every this many seconds into the next step's "
                                      "`metrics` under `system/` (0: off)", ge=0, le=3600,
                                      readers="client")
