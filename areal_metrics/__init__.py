"""areal-metrics: the Python client (`init`), the command line and the local stack.

`import areal_metrics as am; run = am.init(...)` is all a trainer needs; W&B's module-level
calls work too (`am.log`, `am.finish`, `am.alert`, `am.summary`, `am.run`: the current run). The
client lives in `areal_metrics.producers.client.run` and is imported on first use, so importing
this package pulls in no stream, store, plotting or torch package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal_metrics.producers.client.run import AlertLevel, DisabledRun, Run, RunStats, alert, finish, init, log
    from areal_metrics.producers.client.trainer_control import CommandApplier

# `run` and `summary` (the current run's) are attributes too, left out here: `import *` before init would fail
__all__ = ["AlertLevel", "CommandApplier", "DisabledRun", "Run", "RunStats", "alert", "finish", "init", "log",
           "__version__"]
_CLIENT = frozenset(("AlertLevel", "DisabledRun", "Run", "RunStats", "alert", "finish", "init", "log"))
_CURRENT = frozenset(("run", "summary"))  # of the current run: looked up at each access, as wandb.run
_APPLIER = frozenset(("CommandApplier",))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("areal-metrics")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        globals()["__version__"] = found = _version()
        return found
    if name in _CLIENT:
        from areal_metrics.producers.client import run as client

        return getattr(client, name)
    if name in _CURRENT:
        from areal_metrics.producers.client import run as client

        return client.current() if name == "run" else client.summary()
    if name in _APPLIER:  # torch is imported by its methods only
        from areal_metrics.producers.client import trainer_control

        return getattr(trainer_control, name)
    raise AttributeError(f"module 'areal_metrics' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CLIENT | _CURRENT | _APPLIER | {"__version__"})
