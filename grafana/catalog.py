"""All dashboards: build them, serialise them, write them under grafana/dashboards/.

`python -m areal_metrics.grafana` regenerates the committed JSON; a test
fails when the committed files differ from what the code builds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard

from areal_metrics.grafana import alerts, efficiency, evaluation, explorer, runs, training

# file name (without .json) -> builder
BUILDERS: dict[str, Callable[[], dash_b.Dashboard]] = {
    "training": training.build,
    "evaluation": evaluation.build,
    "runs": runs.build,
    "efficiency": efficiency.build,
    "alerts": alerts.build,
    "explorer": explorer.build,
}
FOLDER = "AReaL"


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def dashboards_dir() -> Path:
    return repo_root() / "grafana" / "dashboards"


def build(name: str) -> dashboard.Dashboard:
    """The typed model of one dashboard, with stable panel ids (1, 2, ... in layout order)."""
    model = BUILDERS[name]().build()
    for panel_id, panel in enumerate(model.panels or [], start=1):
        panel.id_val = panel_id
    return model


def to_dict(model: dashboard.Dashboard) -> dict[str, object]:
    """The dashboard as Grafana stores it (plain JSON types)."""
    return json.loads(json.dumps(model, cls=JSONEncoder))


def render(model: dashboard.Dashboard) -> str:
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def all_models() -> dict[str, dashboard.Dashboard]:
    return {name: build(name) for name in BUILDERS}


def write_all(directory: Path) -> list[Path]:
    """Write every dashboard as <name>.json into `directory`; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in all_models().items():
        path = directory / f"{name}.json"
        path.write_text(render(model))
        written.append(path)
    return written
