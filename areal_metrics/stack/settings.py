"""The local stack's own settings: the supervisor's restarts (AREAL_RESTART_*) and the local
broker's JVM (AREAL_KAFKA_HEAP, AREAL_KAFKA_JARS, XDG_CACHE_HOME); read where `up` and the supervisor begin, by
the contract's one parser (docs/SETTINGS.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from areal_metrics.producers.contract.settings import PATH, SettingGroup, setting


@dataclass(frozen=True)
class StackSettings(SettingGroup):
    """The local stack: `areal-metrics up`, its broker and the services' supervisor"""

    restart_max: int = setting("AREAL_RESTART_MAX", 10, "restarts in a row of a service `up` supervises (each "
                               "after a run shorter than a minute) before its supervisor gives up",
                               ge=0, le=1_000_000, readers="stack")
    restart_backoff_s: float = setting("AREAL_RESTART_BACKOFF_S", 1.0, "the first wait before a service is "
                                       "restarted, seconds; doubled per restart in a row, at most 30 s",
                                       ge=0, le=3600, readers="stack")
    kafka_heap: str = setting("AREAL_KAFKA_HEAP", "-Xmx512m -Xms128m", "JVM heap flags of the local broker",
                              readers="stack")
    kafka_jars: Annotated[str, PATH] | None = setting(
        "AREAL_KAFKA_JARS", None, "a folder of Kafka broker jars to use instead of "
        "fetching them", readers="stack",
        default_doc="`$XDG_CACHE_HOME/areal-metrics/kafka-<version>`")
    xdg_cache_home: Annotated[str, PATH] | None = setting(
        "XDG_CACHE_HOME", None, "the user's cache folder (the XDG base directories): the local broker's jars "
        "are fetched into areal-metrics/kafka-<version> under it unless AREAL_KAFKA_JARS names a folder",
        readers="stack", default_doc="`~/.cache`")

    def kafka_jars_dir(self, version: str) -> Path:
        """The folder of the local broker's jars: AREAL_KAFKA_JARS, else the cache's."""
        if self.kafka_jars:
            return Path(self.kafka_jars)
        cache = Path(self.xdg_cache_home) if self.xdg_cache_home else Path.home() / ".cache"
        return cache / "areal-metrics" / f"kafka-{version}"
