"""verl: a backend for its `Tracking` (`verl.utils.tracking`), the logger its trainers write to.

    from areal_metrics.integrations import verl as am_verl
    am_verl.install(tags=["ppo"])   # in the driver, before the trainer's fit()
    trainer.fit()                   # every Tracking verl creates also logs to areal-metrics

verl's `RayPPOTrainer.fit` creates its `Tracking(project_name, experiment_name,
default_backend, config)` itself, on the driver (the one process that logs),
and calls `tracking.log(data=metrics, step=global_steps)` with names such as
`critic/score/mean`, `actor/entropy`, `actor/ppo_kl`, `perf/throughput`; the
client's aliases put them in the typed columns. `install()` wraps
`Tracking.__init__` so that each new instance gets an `areal_metrics` backend
(a run named after the experiment, its `run_id` the experiment name when that is
a valid id, else its slug and a short hash; `group` = the project, `config` =
verl's config, `world_size=1`), and `Tracking.finish(exit_code)` so that the
run ends `finished` (exit code 0) or `failed`. `attach(tracking)` does the same
for one instance you hold. verl's loop has no hook for commands: this backend
only reports (poll `backend.run.commands()` in a loop of your own).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from areal_metrics.producers.client.run_info import run_id_for

BACKEND = "areal_metrics"  # the key in Tracking.logger


class VerlBackend:
    """What `Tracking.logger` holds for areal-metrics: `log(data, step)` and `finish(exit_code)`."""

    def __init__(self, run: Any, owns_run: bool) -> None:
        self.run = run
        self._owns_run = owns_run

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self.run.log(data, step=step)

    def finish(self, exit_code: int = 0) -> None:
        if self._owns_run:
            self.run.finish("finished" if exit_code == 0 else "failed", exit_code)


def attach(tracking: Any, run: Any = None, **init_kwargs: Any) -> VerlBackend:
    """Add an areal-metrics backend to one `Tracking` instance (idempotent); returns it."""
    if run is not None and init_kwargs:
        raise TypeError("attach(): pass either run= or init() keywords, not both")
    existing = tracking.logger.get(BACKEND)
    if existing is not None:
        return existing
    owns = run is None
    if owns:
        import areal_metrics

        run = areal_metrics.init(**{**_defaults(tracking), **init_kwargs, "world_size": 1})
    backend = VerlBackend(run, owns)
    tracking.logger[BACKEND] = backend
    return backend


def install(**init_kwargs: Any) -> None:
    """Give every `Tracking` created from now on an areal-metrics backend (`init_kwargs` for its run)."""
    from verl.utils.tracking import Tracking

    if getattr(Tracking.__init__, "_areal_metrics", False):
        return
    original_init, original_finish = Tracking.__init__, Tracking.finish

    @functools.wraps(original_init)
    def __init__(self: Any, project_name: Any, experiment_name: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, project_name, experiment_name, *args, **kwargs)
        config = kwargs.get("config", args[1] if len(args) > 1 else None)  # (project, experiment, backend, config)
        self._areal_metrics_names = (project_name, experiment_name, config)
        attach(self, **init_kwargs)

    @functools.wraps(original_finish)
    def finish(self: Any, exit_code: int = 0) -> None:
        done = getattr(self, "_finished", False)
        original_finish(self, exit_code)
        backend = getattr(self, "logger", {}).get(BACKEND)
        if backend is not None and not done:
            backend.finish(exit_code)

    __init__._areal_metrics = True  # type: ignore[attr-defined]
    Tracking.__init__, Tracking.finish = __init__, finish


def _defaults(tracking: Any) -> dict[str, Any]:
    project, experiment, config = getattr(tracking, "_areal_metrics_names", (None, None, None))
    out: dict[str, Any] = {"framework": "verl", "config": config}
    if isinstance(experiment, str) and experiment.strip():  # any name: a valid id from it, the name kept
        out["run_id"], out["name"] = run_id_for(experiment), experiment
    if isinstance(project, str) and project:
        out["group"] = project
    return out
