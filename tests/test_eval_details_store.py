"""Evaluation details in the real embedded store (chdb): the trainer's rounds, sent through the public
client, give a `generations` table with distinct prompts per round, each with gold answer and error
type; `eval_consensus.metrics` holds pass@K, maj@K, greedy_accuracy; migration 7 adds the columns
to an older store, idempotently, keeping its rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from areal_metrics.areal_train.evalsets import EvalSet
from areal_metrics.areal_train.evaluation import SHOWN_PROMPTS, RoundJob, run_round
from areal_metrics.areal_train.gate import TwoStage
from areal_metrics.areal_train.policy import Policy
from areal_metrics.areal_train.reporting import Reporter, RunSpec
from areal_metrics.areal_train.task import make_eval_set
from areal_metrics.producers.contract.events import EvalConsensusEvent, EvalEvent
from areal_metrics.sinks.migrations import applied_version, apply_schema
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import SCHEMA_VERSION
from areal_metrics.sinks.writer import insert_rows
from tests.train_capture import ClientCapture


@pytest.fixture
def client(tmp_path: Path) -> Iterator[object]:
    c = open_client(Target.parse(f"chdb://{tmp_path / 'clickhouse'}"), readonly=False, use_database=False)
    apply_schema(c)
    yield c
    c.close()  # chdb: one data directory per process at a time


def trainer_rounds(tmp_path: Path, world: int = 2) -> list[EvalEvent]:
    """Two rounds (steps 0 and 5, other weights) of `world` ranks, as the trainer publishes them."""
    evalset = EvalSet("math_id", tuple(make_eval_set("math_id", 24)), k=2, attempt_len=8, seed=7)
    capture = ClientCapture(tmp_path / "journals")
    for step, seed in ((0, 0), (5, 1)):
        torch.manual_seed(seed)
        policy = Policy(d_model=32, layers=2, heads=2).eval()
        for rank in range(world):
            run = capture.open_run(RunSpec("run-g", rank, world, 0, f"node-{rank}", {}, (), None))
            job = RoundJob(step=step, round_no=step, rank=rank, world_size=world, quick_size=8, force_full="test")
            run_round(policy, {"math_id": evalset}, job, {}, TwoStage(), Reporter(run, "run-g").evaluation, "cpu")
            run.finish()
    return [e for e in capture.events() if isinstance(e, EvalEvent)]


def test_generations_after_a_run_show_distinct_prompts_per_round_with_gold_and_error_type(client, tmp_path) -> None:
    events = trainer_rounds(tmp_path)
    insert_rows(client, "areal", [Located(e, "areal.evals", 0, i) for i, e in enumerate(events)], "t1")
    rows = client.query(
        "SELECT step, uniqExact(prompt), countIf(gold = ''), countIf((error_type = '') != (verdict = 1)), "
        "groupUniqArray(error_type) FROM areal.v_generations WHERE stage = 'full' GROUP BY step ORDER BY step"
    ).result_rows
    assert [r[0] for r in rows] == [0, 5]
    for _step, prompts, no_gold, mismatched, _types in rows:
        assert prompts == SHOWN_PROMPTS and no_gold == 0 and mismatched == 0
    per_round = client.query("SELECT step, groupUniqArray(prompt) FROM areal.v_generations WHERE stage = 'full' "
                             "GROUP BY step ORDER BY step").result_rows
    assert set(per_round[0][1]) == set(per_round[1][1])  # the same prompts every round
    metrics = client.query("SELECT DISTINCT arraySort(mapKeys(metrics)) FROM areal.v_evals WHERE stage = 'full'"
                           ).result_rows
    assert all({"pass@2", "maj@2", "greedy_accuracy"} <= set(m[0]) for m in metrics)


def test_the_demos_generations_query_shows_the_same_spread_prompts_every_round(client, tmp_path) -> None:
    from areal_metrics.commands.demo_sql import GENERATIONS_SQL

    events = trainer_rounds(tmp_path)
    insert_rows(client, "areal", [Located(e, "areal.evals", 0, i) for i, e in enumerate(events)], "t1")
    result = client.query(GENERATIONS_SQL.replace("v_generations", "areal.v_generations"),
                          parameters={"runs": ["run-g"]})
    run, dataset, rounds, low, high, prompt_sets, samples, with_gold, _types = result.result_rows[0]
    assert (run, dataset, rounds, low, high, prompt_sets) == ("run-g", "math_id", 2, SHOWN_PROMPTS, SHOWN_PROMPTS, 1)
    assert with_gold == samples > 0


def consensus(**more) -> EvalConsensusEvent:
    return EvalConsensusEvent(run_id="r1", node="areal-streams", eval_id="e1", step=20, dataset="math500",
                              stage="full", accuracy=0.6, votes=2, replicas=2, agreement=1.0,
                              ts=1_700_000_000.0, event_id=f"c-{len(more)}", **more)


def test_the_consensus_metrics_reach_the_view(client) -> None:
    insert_rows(client, "areal", [Located(consensus(metrics={"pass@4": 0.8, "maj@4": 0.7, "greedy_accuracy": 0.65}),
                                          "areal.evals.consensus", 0, 0)], "t1")
    assert client.query("SELECT metrics['pass@4'], metrics['maj@4'], metrics['greedy_accuracy'] "
                        "FROM areal.v_eval_consensus").result_rows == [(0.8, 0.7, 0.65)]


def test_migration_7_adds_the_columns_to_an_older_store_and_keeps_its_rows(client) -> None:
    old = EvalEvent(run_id="r1", node="n1", eval_id="e1", step=3, dataset="d", accuracy=1.0, verdicts=[1],
                    samples=[{"prompt": "1+1", "response": "2", "verdict": 1}])
    insert_rows(client, "areal", [Located(old, "areal.evals", 0, 0)], "t1")
    insert_rows(client, "areal", [Located(consensus(), "areal.evals.consensus", 0, 0)], "t2")
    client.command("ALTER TABLE areal.generations DROP COLUMN gold")
    client.command("ALTER TABLE areal.generations DROP COLUMN error_type")
    client.command("ALTER TABLE areal.eval_consensus DROP COLUMN metrics")
    client.command("ALTER TABLE areal.schema_migrations DELETE WHERE version >= 7 SETTINGS mutations_sync = 1")
    assert applied_version(client) == 6
    assert apply_schema(client) == SCHEMA_VERSION == 10 and apply_schema(client) == 10  # idempotent (8: command_acks, 9: step aggregates, 10: v_step_means per run)
    assert client.query("SELECT prompt, gold, error_type FROM areal.v_generations").result_rows == [("1+1", "", "")]
    assert client.query("SELECT eval_id, metrics FROM areal.v_eval_consensus").result_rows == [("e1", {})]
