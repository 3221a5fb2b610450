"""AReaL's evaluations become eval events (issue 32): areal 1.0.4's real `StatsLogger` receives what its
trainer commits after an evaluation (the evaluation rollout's statistics, recorded by AReaL's own
`stats_tracker` under the `eval-rollout` scope and exported with the training statistics); the
integration turns them into one `log_eval` per dataset, and the stream worker's vote makes a consensus
of them (value rule with the sample count; the per-sample vote when `eval_verdicts` gives verdicts)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal_metrics.integrations.areal import evaluations
from areal_metrics.producers.contract.events import EvalEvent, parse_event
from areal_metrics.streams.core.config import RunConfig
from areal_metrics.streams.core.processor import RunState, on_eval
from tests import integration_support, test_client_broker
from tests.integration_support import OFFLINE
from tests.support import ROOT, child_env, wait_for

sink = test_client_broker.sink  # the fixture: the real sink as a process, queried through its endpoint
stream_worker = integration_support.stream_worker  # the fixture: the real stream worker as a process

SCRIPT = """
    import sys
    from areal.api import FinetuneSpec
    from areal.api.cli_args import BaseExperimentConfig, StatsLoggerConfig, ValidDatasetConfig
    from areal.utils import stats_tracker
    from areal.utils.stats_logger import StatsLogger
    from areal_metrics.integrations.areal import attach

    root = sys.argv[1]
    names = dict(experiment_name="areal-eval", trial_name="t0")
    config = BaseExperimentConfig(**names, valid_dataset=ValidDatasetConfig(path="/data/gsm8k"),
                                  stats_logger=StatsLoggerConfig(**names, fileroot=root))
    logger = StatsLogger(config, FinetuneSpec(total_train_epochs=1, dataset_size=32, train_batch_size=8))
    verdicts = {("hard", 2): [1, 0, 0, 1, 1, 0, 0, 0]}  # what a user's eval workflow collected
    offline = dict(kafka_bootstrap="127.0.0.1:9", journal_dir=root + "/journal") if sys.argv[2] == "journal" else {}
    run = attach(logger, **offline, git=False,
                 eval_verdicts=lambda dataset, step: verdicts.get((dataset, step)))
    for step in range(4):
        stats_tracker.get("ppo_actor").scalar(reward=0.1 * step)
        if step in (0, 2):  # AReaL's evaluator ran this step: its workflows record in the eval-rollout scope
            for r in [1.0, 0.0, 1.0, 1.0] * (step + 1):
                stats_tracker.get("eval-rollout").scalar(reward=r)
            if step == 2:
                with stats_tracker.get("eval-rollout").scope("hard"):
                    for v in verdicts[("hard", 2)]:
                        stats_tracker.get("eval-rollout").scalar(reward=float(v))
        logger.commit(0, step, step, stats_tracker.export_all(reduce_group=None))  # as _export_and_commit_stats
    logger.close()
    print("done", run.run_id)
"""


def run_areal(tmp_path: Path, mode: str, env: dict[str, str]) -> None:
    env = {**env, **OFFLINE, "WANDB_MODE": "disabled", "WANDB_SILENT": "true"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path), mode], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split()[-2:] == ["done", "areal-eval-t0"], out.stdout[-2000:]


def areal_events(tmp_path: Path) -> list[EvalEvent]:
    """The eval events the integration sends, read back from the client's journal (no broker)."""
    run_areal(tmp_path, "journal", dict(os.environ))
    events = [parse_event(line.split(b"\t", 2)[2])
              for line in (tmp_path / "journal" / "journal.log").read_bytes().splitlines()]
    return [e for e in events if isinstance(e, EvalEvent)]


def test_areals_evaluation_output_gives_eval_events_and_a_consensus(tmp_path: Path) -> None:
    evals = areal_events(tmp_path)
    assert [(e.step, e.dataset) for e in evals] == [(0, "gsm8k"), (2, "gsm8k"), (2, "hard")]
    first, second, hard = evals
    assert (first.accuracy, first.reward, first.n_samples, first.verdicts) == (0.75, 0.75, 4, None)
    assert (second.accuracy, second.n_samples) == (0.75, 12)
    assert hard.verdicts == (1, 0, 0, 1, 1, 0, 0, 0) and hard.accuracy == 0.375  # the per-sample vote's input
    state, consensus = RunState("areal-eval-t0"), []
    for ev in evals:
        state, outputs = on_eval(state, ev, ev.ts, RunConfig())
        consensus += [o.event for o in outputs if o.event.type == "eval_consensus"]
    assert [(c.step, c.dataset, c.accuracy, c.n_samples, c.votes) for c in consensus] == [
        (0, "gsm8k", 0.75, 4, 1), (2, "gsm8k", 0.75, 12, 1), (2, "hard", 0.375, 8, 1)]
    assert consensus[1].ci_high - consensus[1].ci_low < consensus[0].ci_high - consensus[0].ci_low  # more samples


def test_the_eval_scope_is_split_by_dataset() -> None:
    found = evaluations({"eval-rollout/reward": 0.5, "eval-rollout/reward__count": 8, "eval-rollout/aime/reward": 0.1,
                         "eval-rollout/aime/pass@4": 0.3, "ppo_actor/task_reward/avg": 0.2}, "gsm8k")
    assert found == {"gsm8k": {"reward": 0.5, "reward__count": 8}, "aime": {"reward": 0.1, "pass@4": 0.3}}


@pytest.mark.broker
@pytest.mark.timeout(600)
def test_areals_evaluations_reach_the_consensus_table_through_the_real_worker(stack_env: dict[str, str],
                                                                              tmp_path: Path, stream_worker,
                                                                              sink) -> None:
    run_areal(tmp_path, "broker", child_env(stack_env))
    rows = wait_for(lambda: (r := sink("SELECT step, dataset, accuracy, n_samples, votes FROM v_eval_consensus "
                                       "WHERE run_id = 'areal-eval-t0' ORDER BY step, dataset")) and len(r) == 3 and r,
                    180, "three consensus rows")
    assert rows == [(0, "gsm8k", 0.75, 4, 1), (2, "gsm8k", 0.75, 12, 1), (2, "hard", 0.375, 8, 1)]
