"""areal-metrics: the Python client (`init`), the command line and the local stack.

`import areal_metrics as am; run = am.init(...)` is all a trainer needs; the
client lives in `areal_metrics.producers.client.run` and is imported on first use, so importing
this package pulls in no stream, store, plotting or torch package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_metrics.producers.client.run import Run, RunStats, init

__all__ = ["Run", "RunStats", "init"]
_CLIENT = frozenset(__all__)


def __getattr__(name: str) -> Any:
    if name in _CLIENT:
        from areal_metrics.producers.client import run as client

        return getattr(client, name)
    raise AttributeError(f"module 'areal_metrics' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CLIENT)
