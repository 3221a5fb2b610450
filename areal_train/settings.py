"""The reference trainer's own settings (AREAL_CACHE_DIR), by the contract's one parser
(docs/SETTINGS.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from areal_metrics.producers.contract.settings import PATH, SettingGroup, setting


@dataclass(frozen=True)
class TrainerSettings(SettingGroup):
    """The reference trainer (`areal-metrics train`, `demo`)"""

    cache_dir: Annotated[str, PATH] | None = setting(
        "AREAL_CACHE_DIR", None, "the trainer's cache (warm starts)",
        readers="trainer", default_doc="`~/.cache/areal-metrics`")
