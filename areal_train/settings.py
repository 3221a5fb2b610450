"""The reference trainer's own settings (AREAL_CACHE_DIR), by the contract's one parser
(docs/SETTINGS.md). A process's entry point reads them (the torchrun worker's main, the CLI's
`train`, the launcher for the ranks' environment) and passes the folders down."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from areal_metrics.producers.contract.settings import PATH, SettingGroup, setting


@dataclass(frozen=True)
class TrainerSettings(SettingGroup):
    """The reference trainer (`areal-metrics train`, `demo`)"""

    cache_dir: Annotated[str, PATH] | None = setting(
        "AREAL_CACHE_DIR", None, "the trainer's cache (warm starts)",
        readers="trainer", default_doc="`~/.cache/areal-metrics`")

    def warmstart_dir(self) -> Path:
        """Where the warm starts are cached: `warmstart/` in AREAL_CACHE_DIR, else in ~/.cache/areal-metrics."""
        return Path(self.cache_dir or Path.home() / ".cache" / "areal-metrics") / "warmstart"
