"""A real 4-rank run (gloo processes, an evaluation process per rank) with one evaluator made faulty by
the fault injection (`dissent_rank`): what the ranks publish, voted per sample as the contract says,
gives the honest replicas' verdicts and outvotes only the faulty node. Without a broker: the client
journals every event (an unreachable bootstrap), and the test reads the journals back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from areal_metrics.areal_train.config import TrainConfig
from areal_metrics.areal_train.launch import launch
from areal_metrics.producers.contract.events import EvalEvent, parse_event
from areal_metrics.producers.contract.statistics import node_majority
from tests.test_train_distributed import TINY


def journaled(home: Path) -> list[EvalEvent]:
    out = []
    for journal in sorted(home.rglob("journal.log")):
        for line in journal.read_bytes().splitlines():
            event = parse_event(line.split(b"\t", 2)[2])
            if isinstance(event, EvalEvent):
                out.append(event)
    return out


@pytest.mark.parametrize("redundancy", [None, 2])
def test_a_faulty_evaluator_among_four_ranks_is_outvoted_alone(tmp_path: Path, redundancy: int | None) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "AREAL_HOME": str(home), "AREAL_KAFKA_BOOTSTRAP": "127.0.0.1:9"}
    cfg = TrainConfig(**{**TINY, "publish": True}, eval_every_steps=None, eval_at_end=False, eval_mode="async",
                      eval_redundancy=redundancy, dissent_rank=1, checkpoint_dir=str(tmp_path / "ckpt"))
    assert launch("faulty-run", 4, 1, cfg, env=env, log_dir=tmp_path / "logs", timeout=600) == 0
    full = [e for e in journaled(home) if e.stage == "full" and e.status == "ok"]
    for dataset in ("math_id", "math_hard"):
        events = [e for e in full if e.dataset == dataset]
        assert len(events) == 4
        assert {(e.replicas, e.shard_nodes) for e in events} == {(redundancy or 3, 4)}
        nodes = {e.node: dict(zip(e.sample_ids, e.verdicts)) for e in events}
        decided = node_majority(nodes.values())
        assert sorted(decided) == list(range(16 * 2))  # every sample decided: no tie left
        faulty = next(n for n in nodes if n.endswith("-r1"))
        for node, verdicts in nodes.items():
            outvoted = [s for s, v in verdicts.items() if decided[s] != v]
            assert bool(outvoted) == (node == faulty), (node, outvoted)
        honest = {s: v for n, vs in nodes.items() if n != faulty for s, v in vs.items()}
        assert decided == honest
