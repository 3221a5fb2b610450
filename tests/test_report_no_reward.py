"""`report` for a run that logs evaluations but no `reward` column (AReaL's step names, say): figure 1
is drawn all the same. Its own module: the embedded store is one directory per process at a time."""

from __future__ import annotations

from pathlib import Path

from areal_metrics.producers.contract.events import Event
from areal_metrics.analysis.report import FILES, write_report
from tests.test_grafana_data import loaded_store


def test_a_run_with_evaluations_and_no_reward_still_gets_figure_1(tmp_path: Path) -> None:
    """AReaL's step names need not map to `reward`: its evaluations are drawn all the same."""
    from areal_metrics.producers.contract.events import EvalConsensusEvent, EvalEvent, StepEvent

    run = "areal-eval"
    events: list[Event] = [StepEvent(run_id=run, step=s, epoch=0, metrics={"ppo_actor/x": 0.1 * s},
                                     ts=1_700_000_000 + s) for s in range(4)]
    events += [EvalEvent(run_id=run, eval_id=f"e{s}", step=s, dataset="gsm8k", accuracy=0.75, n_samples=4,
                         ts=1_700_000_010 + s) for s in (0, 2)]
    events += [EvalConsensusEvent(run_id=run, eval_id=f"e{s}", step=s, dataset="gsm8k", accuracy=0.75, votes=1,
                                  replicas=1, agreement=1.0, n_samples=4, ci_low=0.3, ci_high=0.95,
                                  ts=1_700_000_020 + s) for s in (0, 2)]
    with loaded_store(tmp_path / "store", events) as store:
        names = [p.name for p in write_report(tmp_path / "out", [run], store)]
    assert names[0] == FILES[0] and FILES[1] not in names  # figure 1, though no step carries a reward
