"""The recorded real run (tests/data/demo_events.jsonl) and loading it through the sink's code path.

The fixture holds two real training runs, recorded from the trainer before issue 11,
and what the stream worker's real logic derives from them (`tests/data/make_demo_events.py`
derives those again). Loading
uses the sink's own row building and insert (`areal_metrics.sinks.writer.insert_rows`) into
the sink's schema (`areal_metrics.sinks.migrations.apply_schema`) on the embedded engine, so the
dashboards' and the report's tests read exactly what a running sink stores.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from areal_metrics.producers.contract.events import Event, parse_event
from areal_metrics.producers.contract.settings import Settings
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.sinks.migrations import apply_schema
from areal_metrics.sinks.query import DirectStore, Target, connect, open_client
from areal_metrics.sinks.rows import Located, table_for
from areal_metrics.sinks.schema import SchemaOptions
from areal_metrics.sinks.writer import insert_rows

FIXTURE = Path(__file__).parent / "data" / "demo_events.jsonl"
RUNS = ("demo-g4", "demo-g2")


def fixture_events() -> list[Event]:
    return [parse_event(line) for line in FIXTURE.read_text().splitlines() if line.strip()]


def load_events(client: Any, events: list[Event], database: str = "areal") -> dict[str, int]:
    """Create the schema and insert the events table by table, as the sink does; rows per table."""
    apply_schema(client, SchemaOptions(database=database))
    topics = Topics("areal.")
    by_table: dict[str, list[Event]] = defaultdict(list)
    for event in events:
        by_table[table_for(event).name].append(event)
    counts = {}
    for name, evs in by_table.items():
        rows = [Located(ev, topics.for_event(ev), 0, offset) for offset, ev in enumerate(evs)]
        counts[name] = insert_rows(client, database, rows, token=f"fixture-{name}-{len(rows)}")
    return counts


def write_events(directory: Path, events: list[Event] | None = None) -> Settings:
    """Store the fixture (or `events`) in an embedded store in `directory`; its settings."""
    url = f"chdb://{directory}"
    client = open_client(Target.parse(url), readonly=False, use_database=False)
    try:
        load_events(client, fixture_events() if events is None else events)
    finally:
        client.close()
    return Settings(clickhouse_url=url)


@contextmanager
def loaded_store(directory: Path, events: list[Event] | None = None) -> Iterator[DirectStore]:
    """A read-only session (as every reader opens it) on a store holding the fixture; closed on exit."""
    store = connect(write_events(directory, events))
    assert isinstance(store, DirectStore)
    try:
        yield store
    finally:
        store.close()


def fixture_span(events: list[Event]) -> tuple[datetime, datetime]:
    ts = [e.ts for e in events]
    return datetime.fromtimestamp(min(ts), timezone.utc), datetime.fromtimestamp(max(ts), timezone.utc)


# ----------------------------------------------------------------------- tests


def test_fixture_is_a_real_two_run_training_with_derived_events() -> None:
    events = fixture_events()
    kinds = defaultdict(int)
    for e in events:
        kinds[e.type] += 1
    assert set(kinds) == {"step", "eval", "eval_consensus", "reward_smoothed", "command", "alert", "rejected", "run",
                          "command_ack"}  # the trainers acknowledge the worker's scale_lr
    steps = [e for e in events if e.type == "step"]
    assert {e.run_id for e in steps} == set(RUNS)
    for run in RUNS:
        mine = [e for e in steps if e.run_id == run]
        assert {(e.node, e.rank) for e in mine} and len({e.rank for e in mine}) == 2  # two ranks per run
        assert sorted({e.step for e in mine}) == list(range(1, 201))
        first = sum(e.reward for e in mine[:40]) / 40
        last = sum(e.reward for e in mine[-40:]) / 40
        assert last > first + 0.1, (run, first, last)  # the policy learned something
    consensus = [e for e in events if e.type == "eval_consensus"]
    # demo-g2's dissenting replica is one of two: its disagreements are ties, undecided, nobody named
    assert any(e.stale for e in consensus) and any(e.n_undecided for e in consensus)
    assert not any(e.dissenters for e in consensus)
    assert any(e.type == "command" and e.command == "scale_lr" and e.reason.startswith("evaluation ") for e in events)


def test_loading_twice_counts_each_event_once(tmp_path: Path) -> None:
    events = fixture_events()
    settings = write_events(tmp_path, events)
    client = open_client(Target.parse(settings.clickhouse_url), readonly=False, use_database=False)
    load_events(client, events[:300])  # a redelivery of the first 300 events, another batch
    client.close()
    with connect(settings) as store:
        assert store.command("SELECT count() FROM areal.steps FINAL") == sum(e.type == "step" for e in events)
        assert store.command("SELECT count() FROM areal.v_evals") == sum(e.type == "eval" for e in events)
        rows = store.query("SELECT uniqExact(event_id) = count() FROM areal.alerts FINAL").rows
        assert rows == [(True,)] or rows == [(1,)]
