"""The evaluation statistics in ClickHouse (embedded chdb): the consensus's n_samples,
n_undecided, ci_low, ci_high and a sharded round's sample_ids / shard_nodes, in their tables
and views; migration 6 adds them to a store made before, idempotently, keeping its rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from areal_metrics.producers.contract.events import EvalConsensusEvent, EvalEvent
from areal_metrics.sinks.migrations import applied_version, apply_schema
from areal_metrics.sinks.query import Target, open_client
from areal_metrics.sinks.rows import Located
from areal_metrics.sinks.schema import SCHEMA_VERSION
from areal_metrics.sinks.writer import insert_rows

NEW_CONSENSUS = ("n_samples", "n_undecided", "ci_low", "ci_high")


@pytest.fixture
def client(tmp_path: Path) -> Iterator[object]:
    c = open_client(Target.parse(f"chdb://{tmp_path / 'clickhouse'}"), readonly=False, use_database=False)
    apply_schema(c)
    yield c
    c.close()  # chdb: one data directory per process at a time


def consensus(**more) -> EvalConsensusEvent:
    return EvalConsensusEvent(run_id="r1", node="areal-streams", eval_id="e1", step=20, dataset="math500",
                              stage="full", accuracy=0.6, votes=4, replicas=3, agreement=0.95, dissenters=("n2",),
                              ts=1_700_000_000.0, event_id=f"c-{len(more)}", **more)


def test_the_consensus_interval_and_the_sharded_layout_reach_the_views(client) -> None:
    with_stats = consensus(n_samples=120, n_undecided=8, ci_low=0.51, ci_high=0.68)
    older = consensus()  # written before the fields existed: NULLs, not zeros
    insert_rows(client, "areal", [Located(with_stats, "areal.evals.consensus", 0, 0),
                                  Located(older, "areal.evals.consensus", 0, 1)], "t1")
    rows = client.query("SELECT event_id, n_samples, n_undecided, ci_low, ci_high FROM areal.v_eval_consensus "
                        "ORDER BY event_id").result_rows
    assert rows == [("c-0", None, None, None, None), ("c-4", 120, 8, 0.51, 0.68)]
    ev = EvalEvent(run_id="r1", node="n1", eval_id="e1", step=20, dataset="math500", accuracy=0.5,
                   verdicts=[1, 0], sample_ids=[7, 3], replicas=3, shard_nodes=4)
    plain = EvalEvent(run_id="r1", node="n2", eval_id="e1", step=20, dataset="math500", accuracy=1.0, verdicts=[1])
    insert_rows(client, "areal", [Located(ev, "areal.evals", 0, 0), Located(plain, "areal.evals", 0, 1)], "t2")
    rows = client.query("SELECT node, sample_ids, shard_nodes FROM areal.v_evals ORDER BY node").result_rows
    assert rows == [("n1", [7, 3], 4), ("n2", [], None)]  # absent sample_ids: [] (0..len-1)


def test_migration_6_adds_the_columns_to_an_older_store_and_keeps_its_rows(client) -> None:
    insert_rows(client, "areal", [Located(consensus(), "areal.evals.consensus", 0, 0)], "t1")
    for name in NEW_CONSENSUS:  # the store as version 4 left it
        client.command(f"ALTER TABLE areal.eval_consensus DROP COLUMN {name}")
    client.command("ALTER TABLE areal.evals DROP COLUMN sample_ids")
    client.command("ALTER TABLE areal.evals DROP COLUMN shard_nodes")
    client.command("ALTER TABLE areal.schema_migrations DELETE WHERE version >= 5 SETTINGS mutations_sync = 1")
    assert applied_version(client) == 4
    assert apply_schema(client) == SCHEMA_VERSION and apply_schema(client) == SCHEMA_VERSION  # idempotent
    cols = {r[0] for r in client.query("SELECT name FROM system.columns WHERE database = 'areal' "
                                       "AND table = 'v_eval_consensus'").result_rows}
    assert set(NEW_CONSENSUS) <= cols
    assert client.query("SELECT eval_id, n_samples FROM areal.v_eval_consensus").result_rows == [("e1", None)]
    insert_rows(client, "areal", [Located(consensus(n_samples=64, n_undecided=0, ci_low=0.4, ci_high=0.6),
                                          "areal.evals.consensus", 0, 1)], "t2")
    assert client.command("SELECT count() FROM areal.v_eval_consensus WHERE n_samples = 64") == 1
