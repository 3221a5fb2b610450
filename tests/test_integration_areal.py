"""AReaL's real `StatsLogger` (areal 1.0.4 from PyPI) teed into a run, against the real broker and sink.

A process builds AReaL's own experiment config and `StatsLogger` (wandb and
swanlab `disabled`, AReaL's defaults; TensorBoard on, to show AReaL's backends
still run), attaches the integration and commits what AReaL's PPO trainer
commits: one dict per step, once a list of two, once a step lower than the
last (AReaL moves it after the last). Every committed dict is one step row at
the step AReaL logged it at, with AReaL's names in the typed columns, its
`__count` keys left out, the fractional epoch, and the run `finished` by
AReaL's `close()`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal_metrics.producers.contract.topics import Topics
from tests import test_client_broker
from tests.integration_support import OFFLINE
from tests.support import ROOT, child_env, wait_for

sink = test_client_broker.sink  # the fixture: the real sink as a process, queried through its endpoint

pytestmark = [pytest.mark.broker, pytest.mark.timeout(600)]

SCRIPT = """
    import sys
    from areal.api import FinetuneSpec
    from areal.api.cli_args import BaseExperimentConfig, StatsLoggerConfig, TensorBoardConfig
    from areal.utils.stats_logger import StatsLogger
    from areal_metrics.integrations.areal import attach

    root = sys.argv[1]
    names = dict(experiment_name="areal-exp", trial_name="trial0")
    config = BaseExperimentConfig(**names, stats_logger=StatsLoggerConfig(
        **names, fileroot=root, tensorboard=TensorBoardConfig(path=root + "/tensorboard")))
    logger = StatsLogger(config, FinetuneSpec(total_train_epochs=2, dataset_size=32, train_batch_size=8))
    run = attach(logger, tags=["areal"], git=False)
    assert attach(logger) is run

    def stats(i):  # what AReaL's stats_tracker exports under the ppo_actor scope
        return {"ppo_actor/task_reward/avg": 0.1 * i, "ppo_actor/update/grad_norm": 1.0 + i,
                "ppo_actor/update/lr": 1e-6, "ppo_actor/update/approx_kl/avg": 0.01 * i,
                "ppo_actor/update/entropy/avg": 2.0, "ppo_actor/update/clip_ratio/avg": 0.05,
                "ppo_actor/n_seqs__count": 8, "timeperf/rollout": 0.5}

    for step in range(3):
        logger.commit(0, step, step, stats(step))
    logger.commit(0, 3, 3, [stats(3), stats(4)])  # two steps in one commit: AReaL logs them at 3 and 4
    logger.commit(1, 0, 4, stats(5))  # global step 4 again: AReaL logs it at 5
    logger.close()
    print("committed", run.run_id, run.stats().steps, run.stats().failed)
"""


def test_what_areal_commits_reaches_clickhouse(stack_env: dict[str, str], topics: Topics, tmp_path: Path,
                                               sink) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path / "areal")], cwd=ROOT,
                         env=child_env(stack_env, **OFFLINE, WANDB_MODE="disabled", WANDB_SILENT="true"),
                         capture_output=True, text=True, timeout=400, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split()[-4:] == ["committed", "areal-exp-trial0", "6", "0"], out.stdout[-2000:]
    assert list((tmp_path / "areal" / "tensorboard").glob("events.out.tfevents.*"))  # AReaL's own backend ran

    wait_for(lambda: sink("SELECT count() FROM v_steps WHERE run_id = 'areal-exp-trial0'") == [(6,)], 120,
             "6 step rows")
    rows = sink("SELECT step, epoch, reward, grad_norm, lr, kl, entropy, clip_ratio, metrics, world_size FROM v_steps "
                "WHERE run_id = 'areal-exp-trial0' ORDER BY step")
    assert [r[0] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r[1] for r in rows] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.25]  # epoch + (step + 1) / steps_per_epoch
    for i, (step, _, reward, grad_norm, lr, kl, entropy, clip, metrics, world) in enumerate(rows):
        assert reward == pytest.approx(0.1 * i) and grad_norm == pytest.approx(1.0 + i) and lr == pytest.approx(1e-6)
        assert kl == pytest.approx(0.01 * i) and entropy == 2.0 and clip == pytest.approx(0.05) and world == 1
        assert metrics == {"timeperf/rollout": 0.5}  # the __count key is left out, as AReaL leaves it out
    runs = wait_for(lambda: sink("SELECT status, framework, `group`, tags, config FROM v_runs "
                                 "WHERE run_id = 'areal-exp-trial0' AND status != 'running'"), 60, "the run to finish")
    status, framework, group, tags, config = runs[0]
    assert (status, framework, group, tags) == ("finished", "areal", "areal-exp", ["areal"])
    assert json.loads(config)["stats_logger"]["trial_name"] == "trial0"  # AReaL's config is the run's config
