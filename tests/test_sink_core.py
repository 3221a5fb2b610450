"""The sink's pure core: batching policy, plans, tokens, backoff, rows, decoding (no broker, no ClickHouse)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from areal_metrics.producers.runtime.backoff import Backoff
from areal_metrics.producers.contract.events import CommandEvent, EvalEvent, StepEvent
from areal_metrics.producers.contract.topics import Topics
from areal_metrics.sinks.batching import TOKEN_MAX, Batcher, BatchPolicy, Chunk, Plan, block_token, blocks_by_topic, dedup_token
from areal_metrics.sinks.decode import dead_letter_id, decode
from areal_metrics.sinks.isolate import DataError, isolate
from areal_metrics.sinks.migrations import schema_statements
from areal_metrics.sinks.rows import Located, build_columns, unstorable
from areal_metrics.sinks.schema import TABLES, TABLES_BY_NAME, SchemaOptions, create_table_sql

TOPICS = Topics("x.")


@dataclass
class Msg:
    topic: str
    partition: int
    offset: int
    value: bytes | None
    key: bytes | None = b"r1"
    timestamp: int = 1_700_000_000_000


def test_flush_by_rows_or_time_whichever_first() -> None:
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=3, max_wait_s=1.0))
    b.add(("t", 0), 0, 0, now=10.0)
    assert not b.due(10.5)
    assert b.due(11.0)  # time
    b.add(("t", 1), 0, 0, now=10.6)
    b.add(("t", 1), 1, 1, now=10.6)
    assert b.due(10.6)  # rows
    assert b.wait_left(10.6) == pytest.approx(0.4)


def test_a_quiet_log_flushes_what_is_buffered_before_the_wait_is_out() -> None:
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=100, max_wait_s=1.0, idle_s=0.05))
    assert b.poll_timeout(10.0) == pytest.approx(1.0)  # nothing buffered: nothing to flush early
    assert not b.due(10.0, quiet=True)
    b.add(("t", 0), 0, 0, now=10.0)
    assert b.poll_timeout(10.0) == pytest.approx(0.05)  # rows waiting: poll no longer than idle_s
    assert not b.due(10.05)  # the poll brought more: keep filling the block
    assert b.due(10.05, quiet=True)  # it brought nothing: store the rows now
    assert b.poll_timeout(10.97) == pytest.approx(0.03)  # and never past the wait


def test_idle_flush_off_waits_out_max_wait() -> None:
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=100, max_wait_s=1.0, idle_s=0))
    b.add(("t", 0), 0, 0, now=10.0)
    assert b.poll_timeout(10.0) == pytest.approx(1.0)
    assert not b.due(10.5, quiet=True)
    assert b.due(11.0, quiet=True)


def test_chunks_are_per_partition_contiguous_and_capped() -> None:
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=2, max_wait_s=0))
    for o in range(5):
        b.add(("t", 0), o, o, now=0)
    b.add(("t", 1), 7, 7, now=0)
    b.add(("t", 1), 7, 7, now=0)  # re-fetched: ignored
    chunks = b.take(now=1)
    assert [(c.partition, c.first, c.last, c.items) for c in chunks] == [(0, 0, 1, (0, 1)), (1, 7, 7, (7,))]
    assert b.total == 3
    assert [(c.first, c.last) for c in b.take(now=2)] == [(2, 3)]


def test_a_plan_recut_exactly_after_restart() -> None:
    """After a crash the chunk is cut at the planned end, whatever the timing."""
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=100, max_wait_s=0))
    plans = {("t", 0): Plan(first=10, last=14)}
    for o in range(10, 13):
        b.add(("t", 0), o, o, now=0)
    assert b.take(now=1, plans=plans, positions={("t", 0): 13}) == []  # not reached the end: wait
    for o in range(13, 20):
        b.add(("t", 0), o, o, now=1)
    (chunk,) = b.take(now=2, plans=plans)
    assert (chunk.first, chunk.last, chunk.next_offset) == (10, 14, 15)
    (rest,) = b.take(now=3, plans=plans)  # beyond the plan: cut freely
    assert (rest.first, rest.last) == (15, 19)


def test_a_planned_block_is_cut_again_whole_once_each_of_its_chunks_this_sink_reads_is_read() -> None:
    """After a crash a block goes in again with its token only if it is the same block: each partition of
    its plans (same topic and group) is held back until all of them that this sink reads reached their
    ends; a partition this sink does not read (no position), and a plan already past, hold nothing."""
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=100, max_wait_s=0))
    plans = {("t", 0): Plan(10, 14, "g"), ("t", 1): Plan(0, 2, "g"), ("t", 2): Plan(5, 6, "g"),
             ("u", 0): Plan(0, 1, "g"), ("t", 3): Plan(0, 9, "old")}
    positions = {("t", 0): 10, ("t", 1): 0, ("u", 0): 0, ("t", 3): 10}  # ("t", 2) is another sink's
    for o in range(10, 15):
        b.add(("t", 0), o, o, now=0)
    b.add(("u", 0), 0, 0, now=0)
    b.add(("u", 0), 1, 1, now=0)
    b.add(("t", 3), 10, 10, now=0)  # past its plan: cut freely
    assert [(c.topic, c.partition) for c in b.take(now=1, plans=plans, positions=positions)] == [("t", 3), ("u", 0)]
    for o in range(0, 2):
        b.add(("t", 1), o, o, now=1)
    assert b.take(now=2, plans=plans, positions={**positions, ("t", 1): 2}) == []  # ("t", 1) not at its end yet
    b.add(("t", 1), 2, 2, now=2)
    chunks = b.take(now=3, plans=plans, positions={**positions, ("t", 1): 3})
    assert [(c.partition, c.first, c.last) for c in chunks] == [(0, 10, 14), (1, 0, 2)]


def test_a_planned_block_waits_for_a_slow_partition_only_so_long() -> None:
    """One partition of the block not read again within replan_wait_s: the others are cut (and stored alone)."""
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=100, max_wait_s=0, replan_wait_s=30))
    plans = {("t", 0): Plan(0, 1, "g"), ("t", 1): Plan(0, 1, "g")}
    positions = {("t", 0): 2, ("t", 1): 0}
    b.add(("t", 0), 0, 0, now=0)
    b.add(("t", 0), 1, 1, now=0)
    assert b.take(now=10, plans=plans, positions=positions) == []
    assert b.take(now=39.9, plans=plans, positions=positions) == []
    (chunk,) = b.take(now=40, plans=plans, positions=positions)
    assert (chunk.partition, chunk.first, chunk.last) == (0, 0, 1)


def test_a_block_of_two_partitions_at_the_same_offsets_is_bisected_into_distinct_tokens() -> None:
    """A block holds a topic's chunks of several partitions, whose offsets overlap: each part of a bisection
    has a token of its own (a part named by offsets alone was taken for its sibling and dropped as stored)."""
    ev = StepEvent(run_id="r", step=0, epoch=0)
    rows = [Located(ev, "t", p, o) for p in (0, 1) for o in range(100, 108)]
    bad = {(0, 103), (1, 105)}
    kept: list[tuple[int, int]] = []
    seen: set[str] = set()

    def insert(part: Sequence[Located], token: str) -> int:  # a store that drops a block whose token it has
        if token in seen:
            return len(part)
        if any((r.partition, r.offset) in bad for r in part):
            raise DataError(ValueError("refused"))
        seen.add(token)
        kept.extend((r.partition, r.offset) for r in part)
        return len(part)

    stored, failed = isolate(rows, "t:0:100-107+t:1:100-107", insert)
    assert sorted(kept) == sorted((r.partition, r.offset) for r in rows if (r.partition, r.offset) not in bad)
    assert stored == 14 and sorted((r.partition, r.offset) for r, _ in failed) == sorted(bad)


def test_the_partitions_read_to_their_plans_end_and_held_for_their_block_are_named() -> None:
    """`held` names what the sink pauses: read to the end of its planned chunk, waiting for another chunk of
    its block; not the partition still waiting for its own chunk's rest, nor one cut; empty once cut."""
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=100, max_wait_s=0, replan_wait_s=30))
    plans = {("t", 0): Plan(0, 1, "g"), ("t", 1): Plan(0, 1, "g")}
    b.add(("t", 0), 0, 0, now=0)
    b.add(("t", 0), 1, 1, now=0)
    b.add(("t", 1), 0, 0, now=0)
    b.add(("u", 0), 0, 0, now=0)
    (free,) = b.take(now=1, plans=plans, positions={("t", 0): 2, ("t", 1): 1})
    assert (free.topic, b.held, b.buffered(("t", 0))) == ("u", {("t", 0)}, 2)
    b.add(("t", 1), 1, 1, now=2)
    assert len(b.take(now=2, plans=plans, positions={("t", 0): 2, ("t", 1): 2})) == 2
    assert b.held == set() and b.buffered(("t", 0)) == 0
    b.add(("t", 1), 2, 2, now=3)
    b.take(now=3, plans={("t", 1): Plan(0, 1, "g"), ("t", 0): Plan(5, 9, "g")}, positions={("t", 0): 2, ("t", 1): 3})
    assert b.held == set()  # ("t", 1) is past its plan, ("t", 0) holds nothing buffered


def test_dropping_every_buffer_starts_a_held_blocks_wait_again() -> None:
    """A new consumer reads the block's partitions again from the commit: their wait starts with it."""
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=100, max_wait_s=0, replan_wait_s=30))
    plans = {("t", 0): Plan(0, 1, "g"), ("t", 1): Plan(0, 1, "g")}
    positions = {("t", 0): 2, ("t", 1): 0}
    b.add(("t", 0), 0, 0, now=0)
    b.add(("t", 0), 1, 1, now=0)
    assert b.take(now=10, plans=plans, positions=positions) == [] and b.held == {("t", 0)}
    b.drop()
    assert b.total == 0 and b.held == set()
    b.add(("t", 0), 0, 0, now=35)
    b.add(("t", 0), 1, 1, now=35)
    assert b.take(now=41, plans=plans, positions=positions) == []  # 6 s into its new wait, not 31
    assert len(b.take(now=71, plans=plans, positions=positions)) == 1


def test_a_held_block_does_not_make_every_poll_a_flush() -> None:
    """A planned block waiting for a chunk keeps its buffers: their age must not make the batch due at once
    (every poll a flush of the other partitions, each a tiny block) while it waits."""
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=100, max_wait_s=0.5, idle_s=0))
    plans = {("t", 0): Plan(0, 1, "t:0:0-1+t:1:0-1"), ("t", 1): Plan(0, 1, "t:0:0-1+t:1:0-1")}
    b.add(("t", 0), 0, 0, now=0)
    b.add(("t", 0), 1, 1, now=0)
    assert b.due(now=1)
    assert b.take(now=1, plans=plans, positions={("t", 0): 2, ("t", 1): 0}) == []  # ("t", 1) not read yet
    assert not b.due(now=1.2)
    assert b.due(now=1.5)


def test_a_plan_whose_end_is_gone_is_cut_at_the_position() -> None:
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=100, max_wait_s=0))
    b.add(("t", 0), 10, 10, now=0)
    (chunk,) = b.take(now=1, plans={("t", 0): Plan(10, 14)}, positions={("t", 0): 20})
    assert (chunk.first, chunk.last) == (10, 10)


def test_drop_forgets_buffered_messages() -> None:
    b: Batcher[int] = Batcher(BatchPolicy())
    b.add(("t", 0), 0, 0, now=0)
    b.add(("t", 1), 0, 0, now=0)
    b.drop({("t", 0)})
    assert b.total == 1
    b.drop()
    assert b.total == 0 and b.take(now=1) == []


def test_token_names_the_log_range() -> None:
    assert dedup_token("areal.steps", 2, 100, 199) == "areal.steps:2:100-199"
    assert dedup_token("areal.steps", 2, 100, 199, "replay-1:") == "replay-1:areal.steps:2:100-199"


def test_a_block_of_one_chunk_keeps_its_token_and_a_block_of_several_joins_theirs() -> None:
    one = Chunk("areal.steps", 2, 100, 199, ())
    two = Chunk("areal.steps", 0, 7, 9, ())
    assert block_token([one]) == "areal.steps:2:100-199"  # what a store written before blocks holds
    assert block_token([two, one]) == "areal.steps:0:7-9+areal.steps:2:100-199"
    many = [Chunk("areal.steps", p, 10**12, 10**12 + 4999, ()) for p in range(48)]
    token = block_token(many)
    assert len(token) <= TOKEN_MAX and token.startswith("areal.steps:blocks:")
    assert token == block_token(list(many))  # the same chunks, the same token
    assert token != block_token(many[:-1])


def test_chunks_go_in_one_block_per_topic_in_their_order() -> None:
    chunks = [Chunk("a", 0, 0, 1, ()), Chunk("b", 0, 5, 6, ()), Chunk("a", 2, 3, 3, ())]
    blocks = blocks_by_topic([(c, i) for i, c in enumerate(chunks)])
    assert [[i for _, i in b] for b in blocks] == [[0, 2], [1]]
    # chunks cut again by their plans: by topic and by the block each plan names
    named = {0: "x", 1: "x", 2: "y"}
    blocks = blocks_by_topic([(c, i) for i, c in enumerate(chunks)], lambda c: named[c.partition])
    assert [[i for _, i in b] for b in blocks] == [[0], [1], [2]]


def test_backoff_doubles_up_to_the_cap() -> None:
    b = Backoff(initial_s=0.5, factor=2, max_s=3)
    assert [b.delay(i) for i in range(0, 6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        BatchPolicy(max_rows=0)
    with pytest.raises(ValueError):
        BatchPolicy(idle_s=-0.1)
    with pytest.raises(ValueError):
        BatchPolicy(replan_wait_s=-1)


def test_rows_are_column_oriented_and_identical_when_rebuilt() -> None:
    ev = StepEvent(run_id="r1", step=3, epoch=1, reward=0.25, metrics={"x": 1.5}, ts=1700000000.12345)
    rows = [Located(ev, "x.steps", 1, 42)]
    names, cols = build_columns(TABLES_BY_NAME["steps"], rows)
    assert build_columns(TABLES_BY_NAME["steps"], rows) == (names, cols)
    got = dict(zip(names, (c[0] for c in cols)))
    assert got["step"] == 3 and got["reward"] == 0.25 and got["entropy"] is None
    assert got["metrics"] == {"x": 1.5}
    assert got["ts"] == 1700000000123  # DateTime64(3): milliseconds since the epoch, rounded
    assert (got["_topic"], got["_partition"], got["_offset"]) == ("x.steps", 1, 42)
    assert "_ingested_at" not in names  # filled by the server


@hsettings(deadline=None)  # the first example imports clickhouse_connect
@given(st.floats(min_value=0, max_value=2**32 - 1, allow_nan=False) | st.integers(0, (2**32 - 1) * 1000 - 1).map(lambda ms: ms / 1000 + 0.0005))
def test_ts_ticks_are_what_the_column_stores_for_the_rounded_time(seconds: float) -> None:
    """The ts column is built as integer milliseconds: the same value clickhouse-connect writes
    for the datetime of the time rounded to milliseconds (half-way cases included)."""
    from clickhouse_connect.datatypes.registry import get_from_name

    column = get_from_name("DateTime64(3, 'UTC')")
    ev = StepEvent(run_id="r", step=0, epoch=0, ts=seconds)
    names, cols = build_columns(TABLES_BY_NAME["steps"], [Located(ev, "t", 0, 0)])
    ticks = dict(zip(names, (c[0] for c in cols)))["ts"]
    assert ticks == column._datetime64_ticks(dt.datetime.fromtimestamp(round(seconds, 3), tz=dt.timezone.utc))


def test_command_args_are_canonical_json_and_lists_never_null() -> None:
    cmd = CommandEvent(run_id="r", command="scale_lr", args={"factor": 0.5, "a": [1]})
    names, cols = build_columns(TABLES_BY_NAME["commands"], [Located(cmd, "t", 0, 0)])
    assert dict(zip(names, (c[0] for c in cols)))["args"] == '{"a":[1],"factor":0.5}'
    ev = EvalEvent(run_id="r", eval_id="e", step=1, dataset="d", status="failed", error="boom")
    names, cols = build_columns(TABLES_BY_NAME["evals"], [Located(ev, "t", 0, 0)])
    assert dict(zip(names, (c[0] for c in cols)))["verdicts"] == []


def test_wrong_table_is_refused() -> None:
    ev = StepEvent(run_id="r1", step=0, epoch=0)
    with pytest.raises(ValueError):
        build_columns(TABLES_BY_NAME["evals"], [Located(ev, "t", 0, 0)])


def test_every_contract_field_has_its_column() -> None:
    from areal_metrics.producers.contract.events import EVENT_TYPES
    import msgspec
    from areal_metrics.sinks.schema import NOT_COLUMNS

    for table in TABLES:
        cls = EVENT_TYPES[table.event_type]
        assert table.order_by[0] == "run_id"
        if table.projected:  # generations: the eval's identity, and each sample's own fields
            assert set(table.order_by) <= set(table.insert_columns) and "sample" in table.order_by
            continue
        fields = {f.name for f in msgspec.structs.fields(cls)} - NOT_COLUMNS.get(table.name, frozenset())
        assert fields <= set(table.insert_columns), (table.name, fields - set(table.insert_columns))
        # trainer input is keyed by what it is about (a resumed attempt replaces it); the rest by event
        if table.name in ("steps", "evals"):
            assert table.version == "_version" and "rank" in table.order_by and "event_id" not in table.order_by
        else:
            assert table.order_by[-1] == "event_id" and table.version == "_offset"


def test_decode_valid_invalid_and_deadletter_messages() -> None:
    good = StepEvent(run_id="r1", step=1, epoch=0)
    msgs = [
        Msg("x.steps", 0, 5, good.to_json()),
        Msg("x.steps", 0, 6, b'{"type":"step","run_id":"r1"}'),
        Msg("x.steps", 0, 7, None),
    ]
    d = decode(msgs, TOPICS)
    assert [r.event.event_id for r in d.rows] == [good.event_id]
    assert [dl.event_id for dl in d.dead_letters] == [dead_letter_id("x.steps", 0, 6), dead_letter_id("x.steps", 0, 7)]
    assert "steps." in d.dead_letters[0].reason and d.dead_letters[1].reason == "event: empty message"
    assert decode(msgs, TOPICS).dead_letters == d.dead_letters  # a retry gives the same dead letters
    # a bad message on the dead-letter topic is stored, never re-published
    d2 = decode([Msg("x.deadletter", 1, 3, b"not json")], TOPICS)
    assert d2.dead_letters == [] and d2.rows[0].event.type == "rejected"
    assert d2.rows[0].event.source_topic == "x.deadletter"


def test_cluster_options_change_only_the_engine_and_on_cluster() -> None:
    plain = SchemaOptions()
    clustered = SchemaOptions(cluster="prod", replicated=True)
    sql = create_table_sql(TABLES_BY_NAME["steps"], clustered)
    assert "ON CLUSTER prod" in sql
    assert "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/areal/steps', '{replica}', _version)" in sql
    assert "replicated_deduplication_window" in sql
    ddl = [s for s in schema_statements(clustered) if not s.startswith("INSERT")]  # an INSERT has no ON CLUSTER
    assert ddl and all("ON CLUSTER prod" in s for s in ddl)
    assert not any("ON CLUSTER" in s for s in schema_statements(plain))
    with pytest.raises(ValueError):
        SchemaOptions(database="a; DROP")


def test_tables_and_views_keep_the_contract_names() -> None:
    text = "\n".join(schema_statements())
    for name in ("steps", "evals", "eval_consensus", "rewards_smoothed", "commands", "alerts", "deadletter"):
        assert f"areal.{name} (" in text and f"areal.v_{name} AS SELECT * FROM areal.{name} FINAL" in text


def test_values_no_column_can_hold_are_dead_lettered() -> None:
    """The columns' ranges are the contract's (one validation for the worker and the sink): a rank
    beyond UInt32 or a time beyond what DateTime64(3) holds is refused by the record's rules."""
    fine = StepEvent(run_id="r1", step=2**63 - 1, epoch=0, tokens=2**63 - 1, rank=2**32 - 1, ts=2**32 - 1)
    body = json.loads(fine.to_json())
    too_big = json.dumps({**body, "rank": 2**32, "event_id": "a"}).encode()
    too_late = json.dumps({**body, "ts": 2**32, "event_id": "b"}).encode()  # 2106-02-07
    d = decode([Msg("x.steps", 0, 1, too_big), Msg("x.steps", 0, 2, fine.to_json()), Msg("x.steps", 0, 3, too_late)],
               TOPICS)
    assert [r.event.event_id for r in d.rows] == [fine.event_id]
    assert [x.reason for x in d.dead_letters] == ["steps.rank: must be <= 4294967295", "steps.ts: must be <= 4294967295.0"]
    assert unstorable(fine) is None



@hsettings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 30)), min_size=1, max_size=30),
    st.integers(1, 25),
    st.data(),
)
def test_chunks_cover_every_offset_once_in_order(reads: list[tuple[int, int]], max_rows: int, data: st.DataObject) -> None:
    """Whatever the arrival pattern and cut points, each partition's offsets are cut into
    contiguous chunks of at most max_rows, each offset exactly once, in order."""
    b: Batcher[int] = Batcher(BatchPolicy(max_rows=max_rows, max_wait_s=0))
    next_offset = {0: 0, 1: 0, 2: 0}
    cut: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for partition, n in reads:
        for _ in range(n):
            o = next_offset[partition]
            b.add(("t", partition), o, o, now=0)
            next_offset[partition] += 1
        if data.draw(st.booleans()):
            for c in b.take(now=1):
                assert list(c.items) == list(range(c.first, c.last + 1)) and len(c.items) <= max_rows
                cut[c.partition].extend(c.items)
    while b.total:
        for c in b.take(now=2):
            cut[c.partition].extend(c.items)
    assert cut == {p: list(range(n)) for p, n in next_offset.items()}
